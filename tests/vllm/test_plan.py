"""The connector's scheduler side on its own: what it loads and writes per step.

vLLM's request and scheduler-output objects are stood in for by plain
namespaces with the fields the scheduler side reads (the real ones drive it
in test_connector.py); the tier is a `count_prefix` function.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvrelay.adapters.vllm.scheduler import SchedulerSide
from kvrelay.layout import ModelKVSpec, ParallelConfig, rank_rectangle

PAGE = 4
SPEC = ModelKVSpec(model_id="m", weights_fingerprint="", num_layers=2, num_kv_heads=2,
                   k_head_dim=8, v_head_dim=8, kv_dtype="bfloat16", page_size=PAGE)  # fmt: skip
RECT = rank_rectangle(SPEC, ParallelConfig())


def request(req_id: str, tokens: list[int]):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens),
                           all_token_ids=list(tokens), kv_transfer_params=None)  # fmt: skip


def step(new=(), cached=(), scheduled=None):
    """new: (req_id, blocks, computed); cached: (req_id, new_blocks, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),),
                                            num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
            new_block_ids=[None if b is None else (list(b),) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=scheduled or {},
    )  # fmt: skip


def side(tier_pages: int = 0, fail: bool = False) -> tuple[SchedulerSide, list]:
    asked = []

    def count_prefix(keys):
        asked.append(list(keys))
        if fail:
            raise TimeoutError("no answer")
        return min(tier_pages, len(keys))

    return SchedulerSide(SPEC, RECT, count_prefix), asked


def test_loads_the_tiers_pages_past_the_local_hit_and_writes_the_rest():
    tokens = list(range(5 * PAGE + 1))
    s, asked = side(tier_pages=3)
    r = request("a", tokens)
    assert s.matched_tokens(r, num_computed_tokens=PAGE) == (2 * PAGE, False)
    assert asked == [SPEC.page_keys(tokens[: 5 * PAGE])]  # never the last token's page
    s.after_alloc(r, 2 * PAGE)
    plan = s.plan(step(new=[("a", [10, 11, 12, 13, 14, 15], 3 * PAGE)],
                       scheduled={"a": 2 * PAGE + 1}))  # fmt: skip
    keys = SPEC.page_keys(tokens[: 5 * PAGE])
    assert [(b.keys, b.block_ids) for b in plan.loads] == [(keys[1:3], [11, 12])]
    assert [(b.keys, b.block_ids) for b in plan.saves] == [(keys[3:5], [13, 14])]


def test_a_page_decode_completes_is_written_once():
    tokens = list(range(2 * PAGE - 1))
    s, _ = side()
    r = request("a", tokens)
    assert s.matched_tokens(r, 0) == (0, False)
    plan = s.plan(step(new=[("a", [7, 8], 0)], scheduled={"a": len(tokens)}))
    assert [b.block_ids for b in plan.saves] == [[7]]
    r.all_token_ids.append(99)  # the sampled token, computed by the next step
    plan = s.plan(step(cached=[("a", None, len(tokens))], scheduled={"a": 1}))
    keys = SPEC.page_keys(r.all_token_ids[: 2 * PAGE])
    assert [(b.keys, b.block_ids) for b in plan.saves] == [(keys[1:2], [8])]
    assert s.plan(step(cached=[("a", None, 2 * PAGE)], scheduled={"a": 1})).saves == []


def test_a_tier_that_does_not_answer_is_a_miss():
    s, _ = side(tier_pages=3, fail=True)
    assert s.matched_tokens(request("a", list(range(5 * PAGE))), 0) == (0, False)
    assert s.probe_errors == 1


def test_no_load_when_vllm_allocates_nothing_for_it():
    s, _ = side(tier_pages=2)
    r = request("a", list(range(3 * PAGE + 1)))
    assert s.matched_tokens(r, 0) == (2 * PAGE, False)
    s.after_alloc(r, 0)
    assert s.plan(step(new=[("a", [1, 2, 3, 4], 0)], scheduled={"a": 1})).loads == []


def test_the_page_holding_the_last_token_gives_every_token_before_it():
    s, _ = side(tier_pages=3)
    r = request("a", list(range(3 * PAGE)))
    assert s.matched_tokens(r, 2 * PAGE) == (PAGE - 1, False)  # the last token is computed
    s.after_alloc(r, PAGE - 1)
    plan = s.plan(step(new=[("a", [1, 2, 3], 2 * PAGE)], scheduled={"a": 1}))
    assert [b.block_ids for b in plan.loads] == [[3]]


def test_nothing_to_ask_when_vllm_holds_all_but_the_last_token():
    s, asked = side(tier_pages=3)
    r = request("a", list(range(3 * PAGE)))
    assert s.matched_tokens(r, 3 * PAGE - 1) == (0, False)
    assert asked == []


def test_finished_requests_are_forgotten():
    s, _ = side()
    r = request("a", list(range(PAGE + 1)))
    s.matched_tokens(r, 0)
    assert s.finished(r, ([3],)) is None  # no remote decode asked for: freed now
    assert s.requests == {}


def test_a_load_waits_off_the_step_only_when_the_engine_has_other_requests():
    tokens = list(range(4 * PAGE + 1))
    s, _ = side(tier_pages=3)
    alone = request("a", tokens)
    assert s.matched_tokens(alone, 0) == (3 * PAGE, False)  # nothing to overlap it with
    s.after_alloc(alone, 3 * PAGE, [5, 6, 7, 8, 9])
    assert not s.async_plan.async_loads
    beside = request("b", [t + 1 for t in tokens])
    assert s.matched_tokens(beside, 0) == (3 * PAGE, True)
    # vLLM parks it at once: its load is planned with the blocks allocated now ...
    s.after_alloc(beside, 3 * PAGE, [20, 21, 22, 23, 24])
    plan = s.plan(step(new=[("a", [5, 6, 7, 8, 9], 0)], scheduled={"a": PAGE + 1}))
    keys = SPEC.page_keys(beside.prompt_token_ids[: 3 * PAGE])
    assert [(b.req_id, b.keys, b.block_ids) for b in plan.async_loads] == [
        ("b", keys, [20, 21, 22])
    ]
    assert [b.req_id for b in plan.loads] == ["a"]
    # ... and not again when it is scheduled after the load
    later = s.plan(step(new=[("b", [20, 21, 22, 23, 24], 3 * PAGE)], scheduled={"b": PAGE + 1}))
    assert not later.loads and not later.async_loads


def test_async_loads_can_be_forced_either_way():
    tokens = list(range(2 * PAGE + 1))
    for mode, expected in (("always", True), ("never", False)):
        s = SchedulerSide(SPEC, RECT, lambda keys: len(keys), async_loads=mode)
        s.matched_tokens(request("other", [9] * 3), 0)
        assert s.matched_tokens(request("a", tokens), 0) == (2 * PAGE, expected)
