"""The P/D handoff's parts on their own: block runs, the hold book, the params,
and a service and a puller moving blocks between two real transfer agents
(tcp, loopback). Real vLLM engines drive them in test_connector.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from kvrelay.adapters.vllm.blocks import BlockLayoutError
from kvrelay.adapters.vllm.handoff import (
    HandoffPuller,
    HandoffService,
    HoldBook,
    KvMemory,
    paired_runs,
)
from kvrelay.adapters.vllm.handoff_params import HandoffParams, prefill_reply, remote_prefill
from kvrelay.adapters.vllm.scheduler import HandoffSide, SchedulerSide
from kvrelay.layout import ModelKVSpec, ParallelConfig, rank_rectangle
from kvrelay.transfer import create_agent

TOKEN = "handoff-test"
LAYERS, BLOCKS, HEADS, BLOCK, FUSED = 3, 10, 2, 4, 8
SPEC = ModelKVSpec(model_id="m", weights_fingerprint="", num_layers=LAYERS, num_kv_heads=HEADS,
                   k_head_dim=FUSED // 2, v_head_dim=FUSED // 2, kv_dtype="bfloat16",
                   page_size=BLOCK)  # fmt: skip


def caches(block_major: bool, fill: float | None = None) -> list[torch.Tensor]:
    """Layer views of one allocation, laid out as vLLM does (layer- or block-major)."""
    shape = (LAYERS, BLOCKS) if not block_major else (BLOCKS, LAYERS)
    buf = torch.zeros(*shape, HEADS, BLOCK, FUSED, dtype=torch.bfloat16)
    if fill is None:
        buf.copy_(torch.randn(buf.shape))
    return [buf[i] if not block_major else buf[:, i] for i in range(LAYERS)]


def fake_agent():
    return SimpleNamespace(register_tensor=lambda tensor: SimpleNamespace(tensor=tensor))


def test_block_runs_join_what_is_adjacent():
    memory = KvMemory(fake_agent(), caches(block_major=True), "x")
    size = HEADS * BLOCK * FUSED * 2
    assert memory.block_stride == LAYERS * size
    # Blocks 2 and 3 of every layer are one run in a block-major allocation.
    assert memory.runs([3, 2]) == [(2 * LAYERS * size, 2 * LAYERS * size)]
    layer_major = KvMemory(fake_agent(), caches(block_major=False), "x")
    assert len(layer_major.runs([2, 3])) == LAYERS
    with pytest.raises(IndexError):
        memory.runs([BLOCKS])


def test_paired_runs_split_where_either_side_is_not_contiguous():
    remote = KvMemory(fake_agent(), caches(block_major=True), "x").welcome()
    local = KvMemory(fake_agent(), caches(block_major=True), "x")
    runs, offsets = paired_runs(remote, local, [4, 5, 6], [7, 8, 1])
    size = remote.block_bytes
    assert sum(n for _, n in runs) == 3 * LAYERS * size
    assert len(runs) == 2 and offsets[0] == 7 * local.block_stride  # 4,5 -> 7,8; 6 -> 1
    other = KvMemory(fake_agent(), caches(block_major=True)[:2], "x")
    with pytest.raises(BlockLayoutError):
        paired_runs(remote, other, [1], [1])


def test_a_tokens_outside_heads_layout_moves_whole_blocks():
    # vLLM's GPU NHD: a block's bytes are [block, heads, fused], one run.
    buf = torch.zeros(LAYERS, BLOCKS, BLOCK, HEADS, FUSED, dtype=torch.bfloat16)
    memory = KvMemory(fake_agent(), [buf[i].transpose(1, 2) for i in range(LAYERS)], "x")
    size = HEADS * BLOCK * FUSED * 2
    assert (memory.block_stride, memory.block_bytes) == (size, size)
    assert memory.runs([1, 2]) == [(o * BLOCKS * size + size, 2 * size) for o in range(LAYERS)]
    gapped = torch.zeros(BLOCKS, HEADS, BLOCK, FUSED + 2)[..., :FUSED]  # padding in a block
    with pytest.raises(BlockLayoutError, match="contiguous"):
        KvMemory(fake_agent(), [gapped], "x")


def test_views_of_separate_allocations_are_refused():
    layers = [torch.zeros(BLOCKS, HEADS, BLOCK, FUSED) for _ in range(2)]
    with pytest.raises(BlockLayoutError):
        KvMemory(fake_agent(), layers, "x")


def test_a_hold_ends_when_its_leases_are_released_or_its_time_is_up():
    book = HoldBook()
    book.add("a", [1, 2], time.time() + 60)
    book.add("b", [3], time.time() - 1)
    assert book.take_finished(lambda lease: True) == {"b"}  # expired
    assert book.take_finished(lambda lease: False) == set()  # no lease granted yet
    book.holds["a"].leases.append(7)
    assert book.take_finished(lambda lease: lease == 7) == set()
    assert book.take_finished(lambda lease: False) == {"a"}
    assert set(book.ended) == {"a", "b"}


def params(**changes) -> HandoffParams:
    fields = dict(agents=["127.0.0.1:1"], request_id="p", block_ids=[5, 6, 7], num_tokens=10,
                  namespace=SPEC.namespace().hex(), expires=time.time() + 60)  # fmt: skip
    return HandoffParams(**(fields | changes))


def test_a_decode_loads_every_prompt_token_but_the_last_from_the_prefill():
    s = SchedulerSide(SPEC, rank_rectangle(SPEC, ParallelConfig()), None)
    tokens = list(range(10))
    r = SimpleNamespace(request_id="d", prompt_token_ids=tokens, all_token_ids=tokens,
                        kv_transfer_params=prefill_reply(params()))  # fmt: skip
    assert s.matched_tokens(r, 0) == (9, False)
    assert s.matched_tokens(r, 4) == (5, False)  # past a local hit of one block
    s.after_alloc(r, 5)
    assert r.kv_transfer_params["do_remote_prefill"] is False  # pulled once
    new = SimpleNamespace(req_id="d", block_ids=([11, 12, 13],), num_computed_tokens=4)
    out = SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[]))  # fmt: skip
    (pull,) = s.plan(out).pulls
    assert (pull.remote_block_ids, pull.block_ids) == ([6, 7], [12, 13])


@pytest.mark.parametrize(
    "bad",
    [{"namespace": "00" * 32}, {"expires": time.time() - 1}, {"block_ids": [5]}],
    ids=["another-model", "expired", "too-few-blocks"],
)
def test_a_handoff_that_cannot_be_used_is_a_local_prefill(bad):
    s = SchedulerSide(SPEC, rank_rectangle(SPEC, ParallelConfig()), None)
    tokens = list(range(10))
    r = SimpleNamespace(request_id="d", prompt_token_ids=tokens, all_token_ids=tokens,
                        kv_transfer_params=prefill_reply(params(**bad)))  # fmt: skip
    assert s.matched_tokens(r, 0) == (0, False)


def test_malformed_params_are_refused_with_a_warning(caplog):
    assert remote_prefill({"do_remote_prefill": True, "kvrelay": {"agents": 3}}, b"x") is None
    assert "malformed" in caplog.text


def test_a_finished_prefill_for_a_remote_decode_keeps_its_blocks():
    side = HandoffSide(["127.0.0.1:9000"], hold_s=30)
    s = SchedulerSide(SPEC, rank_rectangle(SPEC, ParallelConfig()), None, side)
    status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    r = SimpleNamespace(request_id="p", prompt_token_ids=[1] * 9, kv_transfer_params={
        "do_remote_decode": True}, status=status, is_finished=lambda: True,
        num_computed_tokens=9)  # fmt: skip
    reply = s.finished(r, ([4, 5, 6],))
    assert reply["kvrelay"]["block_ids"] == [4, 5, 6] and reply["kvrelay"]["num_tokens"] == 9
    assert [h.block_ids for h in s.new_holds] == [[4, 5, 6]]
    aborted = SimpleNamespace(**{**vars(r), "status": SimpleNamespace(name="FINISHED_ABORTED")})
    assert s.finished(aborted, ([4],)) is None


@pytest.mark.asyncio
async def test_a_decode_pulls_held_blocks_and_the_release_ends_the_hold():
    prefill, decode = await create_agent("tcp", token=TOKEN), await create_agent("tcp", token=TOKEN)
    try:
        theirs, ours = caches(block_major=False), caches(block_major=True, fill=0.0)
        book = HoldBook()
        remote = KvMemory(prefill, theirs, "same")
        service = await HandoffService(prefill, remote, book, SPEC.namespace(), TOKEN).start(
            "127.0.0.1", 0
        )
        puller = HandoffPuller(decode, KvMemory(decode, ours, "same"), SPEC.namespace(), TOKEN, 5)
        book.add("p", [2, 3, 7], time.time() + 60)
        await puller.pull(service.server.address, "p", [2, 3, 7], [0, 1, 9])
        for layer in range(LAYERS):
            assert torch.equal(ours[layer][[0, 1, 9]], theirs[layer][[2, 3, 7]])
            assert not ours[layer][2:9].any()  # nothing else written
        # The lease is released before the pull returns (before the decode's
        # forward): the hold has ended.
        assert book.take_finished(lambda lease: prefill.leases.get(lease) is not None) == {"p"}
        with pytest.raises(Exception, match="released"):  # a second pull is refused
            await puller.pull(service.server.address, "p", [2], [0])
        book.add("q", [1], time.time() + 60)
        with pytest.raises(Exception, match="not q's"):
            await puller.pull(service.server.address, "q", [2], [0])
        other = HandoffPuller(decode, KvMemory(decode, ours, "other"), SPEC.namespace(), TOKEN, 5)
        with pytest.raises(BlockLayoutError):
            await other.pull(service.server.address, "q", [1], [0])
        await puller.close()
        await service.close()
    finally:
        await prefill.close()
        await decode.close()
