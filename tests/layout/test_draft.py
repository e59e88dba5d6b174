"""Draft page keys cover the next page's first token; draft rectangles."""

import pytest

from kvrelay.layout import (
    LayoutError,
    ModelKVSpec,
    ParallelConfig,
    draft_page_keys,
    draft_rectangle,
)

TARGET = ModelKVSpec("m", "w", num_layers=4, num_kv_heads=2, k_head_dim=8, v_head_dim=8,
                     kv_dtype="float32", page_size=4)  # fmt: skip
DRAFT = TARGET.draft_spec(
    model_id="m:mtp0", weights_fingerprint="w", num_layers=1, num_kv_heads=2,
    k_head_dim=8, v_head_dim=8,
)  # fmt: skip


def test_a_draft_page_needs_the_next_pages_first_token():
    tokens = list(range(12))
    keys = TARGET.page_keys(tokens)
    assert len(keys) == 3
    # Page 2 is full, but token 12 (first of page 3) is unknown: no draft key.
    assert len(draft_page_keys(DRAFT, keys, tokens)) == 2
    assert len(draft_page_keys(DRAFT, keys, [*tokens, 99])) == 3


def test_prompts_sharing_a_page_but_not_the_next_token_do_not_share_its_draft_page():
    a = list(range(9))
    b = [*a[:8], 100]  # same pages 0 and 1, different token 8
    assert TARGET.page_keys(a)[:2] == TARGET.page_keys(b)[:2]
    da = draft_page_keys(DRAFT, TARGET.page_keys(a), a)
    db = draft_page_keys(DRAFT, TARGET.page_keys(b), b)
    assert da[0] == db[0] and da[1] != db[1]
    # Another target (other weights) or convention never shares draft keys.
    other = TARGET.draft_spec(
        model_id="m:mtp0", weights_fingerprint="w", num_layers=1,
        num_kv_heads=2, k_head_dim=8, v_head_dim=8, positions="shifted",
    )  # fmt: skip
    assert draft_page_keys(other, TARGET.page_keys(a), a)[0] != da[0]


def test_extending_from_a_start_page_gives_the_same_keys():
    tokens = list(range(30))
    keys = TARGET.page_keys(tokens)
    whole = draft_page_keys(DRAFT, keys, tokens)
    assert draft_page_keys(DRAFT, keys[3:], tokens, start=3) == whole[3:]


def test_draft_keys_need_a_draft_spec_and_the_chain_is_refused_for_one():
    with pytest.raises(LayoutError):
        draft_page_keys(TARGET, TARGET.page_keys(list(range(9))), list(range(9)))
    with pytest.raises(LayoutError, match="draft_page_keys"):
        DRAFT.page_keys(list(range(9)))


def test_draft_rectangles_live_on_the_last_stage_split_by_tp():
    assert draft_rectangle(DRAFT, ParallelConfig(tp=2, pp=2, tp_rank=1, pp_rank=0)) is None
    rect = draft_rectangle(DRAFT, ParallelConfig(tp=2, pp=2, tp_rank=1, pp_rank=1))
    assert (rect.head_start, rect.head_end, rect.layer_start, rect.layer_end) == (1, 2, 0, 1)
    replica = draft_rectangle(DRAFT, ParallelConfig(tp=4, tp_rank=1))
    assert (replica.head_start, replica.writer) == (0, False)
