import hashlib
import struct
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.layout import LayoutError, ParallelConfig, page_keys, rank_rectangle
from tests.layout.strategies import TINY_SPEC, kv_specs, parallel_configs

BASE = TINY_SPEC

token_lists = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40)


def test_known_answer_against_an_independent_chain():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    ns = BASE.namespace()
    expect, key = [], ns
    for page in ([1, 2, 3, 4], [5, 6, 7, 8]):
        key = hashlib.sha256(key + struct.pack("<4I", *page)).digest()
        expect.append(key)
    assert BASE.page_keys(tokens) == expect  # the trailing partial page has no key


def test_namespace_is_sha256_of_the_identity_fields():
    import msgpack

    fields = BASE.identity_fields()
    assert list(fields) == [
        "layout_version",
        "model_id",
        "weights_fingerprint",
        "kv_dtype",
        "page_size",
        "num_layers",
        "num_kv_heads",
        "k_head_dim",
        "v_head_dim",
        "attention_kind",
        "salt",
    ]
    assert BASE.namespace() == hashlib.sha256(msgpack.packb(fields, use_bin_type=True)).digest()


# Every identity field, changed alone, must change the namespace (and so every key).
CHANGES = {
    "model_id": "other",
    "weights_fingerprint": "w1",
    "num_layers": 5,
    "num_kv_heads": 4,
    "k_head_dim": 16,
    "v_head_dim": 4,
    "kv_dtype": "bfloat16",
    "page_size": 8,
    "salt": "tenant-b",
}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_any_namespace_field_changes_every_key(field):
    other = replace(BASE, **{field: CHANGES[field]})
    tokens = list(range(64))
    assert other.namespace() != BASE.namespace()
    assert not set(other.page_keys(tokens)) & set(BASE.page_keys(tokens))


def test_attention_kind_changes_the_namespace():
    mha = replace(BASE, num_kv_heads=1, v_head_dim=1)
    mla = replace(BASE, num_kv_heads=1, v_head_dim=0, attention_kind="mla")
    assert mha.namespace() != mla.namespace()


def test_draft_namespace_derives_from_the_target():
    draft_args = dict(
        model_id="mtp",
        weights_fingerprint="d",
        num_layers=1,
        num_kv_heads=2,
        k_head_dim=8,
        v_head_dim=8,
    )
    draft = BASE.draft_spec(**draft_args)
    assert draft.target_namespace == BASE.namespace()
    assert draft.page_size == BASE.page_size and draft.salt == BASE.salt
    assert draft.namespace() != BASE.namespace()
    # Same draft under another target (e.g. other weights) is another namespace.
    other_target = replace(BASE, weights_fingerprint="w1")
    assert other_target.draft_spec(**draft_args).namespace() != draft.namespace()
    # A standalone spec with the draft's fields but no target is not the draft.
    standalone = replace(draft, target_namespace=None, draft_positions=None)
    assert standalone.namespace() != draft.namespace()
    # The RoPE position convention changes the draft's K bytes: another namespace.
    shifted = BASE.draft_spec(**draft_args, positions="shifted")
    assert shifted.namespace() != draft.namespace()


@settings(max_examples=200, deadline=None)
@given(token_lists, st.integers(0, 39), st.integers(1, 2**32 - 1))
def test_a_changed_token_changes_its_page_and_all_later_keys(tokens, position, delta):
    if position >= len(tokens):
        position = len(tokens) - 1
    if position < 0:
        return
    changed = list(tokens)
    changed[position] = (changed[position] + delta) % 2**32
    a, b = BASE.page_keys(tokens), BASE.page_keys(changed)
    page = position // BASE.page_size
    assert a[:page] == b[:page]
    assert all(x != y for x, y in zip(a[page:], b[page:], strict=True))


@settings(max_examples=200, deadline=None)
@given(token_lists, st.integers(0, 40))
def test_keys_of_a_prefix_are_a_prefix_and_chains_extend(tokens, cut):
    keys = BASE.page_keys(tokens)
    assert len(keys) == len(tokens) // BASE.page_size
    cut = cut // BASE.page_size * BASE.page_size  # extend only from a page boundary
    head = BASE.page_keys(tokens[:cut])
    assert keys[: len(head)] == head
    if head:
        assert head + page_keys(head[-1], tokens[cut:], BASE.page_size) == keys


@st.composite
def spec_configs_tokens(draw):
    spec = draw(kv_specs())
    return spec, draw(parallel_configs(spec)), draw(token_lists)


@settings(max_examples=100, deadline=None)
@given(spec_configs_tokens())
def test_keys_are_equal_across_parallel_configs(case):
    """Every rank of any config derives the same keys: parallelism is not identity."""
    spec, config, tokens = case
    expect = spec.page_keys(tokens)
    for rank in [*config.all_ranks(), ParallelConfig()]:
        rank_rectangle(spec, rank)  # a valid rank of that config
        assert spec.page_keys(tokens) == expect


def test_keys_accept_numpy_and_reject_ids_outside_uint32():
    tokens = np.arange(8, dtype=np.int64)
    assert BASE.page_keys(tokens) == BASE.page_keys(list(range(8)))
    with pytest.raises(LayoutError, match="2\\*\\*32"):
        BASE.page_keys([0, 1, 2, 2**32])
    with pytest.raises(LayoutError, match="2\\*\\*32"):
        BASE.page_keys([-1, 1, 2, 3])
    with pytest.raises(LayoutError, match="integers"):
        BASE.page_keys([0.5, 1, 2, 3])
    with pytest.raises(LayoutError, match="32-byte"):
        page_keys(b"short", [1, 2, 3, 4], 4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(model_id=""), "model_id"),
        (dict(num_layers=0), "num_layers"),
        (dict(kv_dtype="int4"), "kv_dtype"),
        (dict(attention_kind="gqa"), "attention_kind"),
        (dict(attention_kind="mla"), "MLA"),
        (dict(v_head_dim=0), "v_head_dim"),
        (dict(page_size=True), "page_size"),
        (dict(target_namespace=b"x"), "32-byte"),
    ],
)
def test_bad_specs_are_rejected(overrides, message):
    with pytest.raises(LayoutError, match=message):
        replace(BASE, **overrides)


def test_page_geometry():
    s = replace(BASE, kv_dtype="bfloat16", k_head_dim=128, v_head_dim=64, page_size=64)
    assert s.block_bytes == 64 * (128 + 64) * 2
    assert s.page_bytes == 2 * 4 * s.block_bytes
    assert s.block_offset(1, 2) == (1 * 4 + 2) * s.block_bytes
    with pytest.raises(LayoutError):
        s.block_offset(2, 0)
