"""The unified page of MLA models with DeepSeek sparse attention: per layer
the latent rows, then the indexer keys of layers whose indexer runs."""

import pytest

from kvrelay.layout import LayoutError, ModelKVSpec, ParallelConfig, rank_rectangle


def glm_spec(**fields) -> ModelKVSpec:
    base = dict(
        model_id="glm_moe_dsa:tiny",
        weights_fingerprint="sha256:00",
        num_layers=4,
        num_kv_heads=1,
        k_head_dim=48,  # 32 latent + 16 rope
        v_head_dim=0,
        kv_dtype="bfloat16",
        attention_kind="mla",
        page_size=16,
        rope_head_dim=16,
        index_head_dim=32,
        index_dtype="float32",
        index_layers=(0, 2),
        index_topk=64,
    )
    return ModelKVSpec(**(base | fields))


def test_layer_blocks_hold_latent_then_indexer_keys():
    spec = glm_spec()
    latent = 16 * 48 * 2
    indexer = 16 * 32 * 4
    assert [spec.layer_block_bytes(layer) for layer in range(4)] == [
        latent + indexer,
        latent,
        latent + indexer,
        latent,
    ]
    assert [spec.layer_offset(layer) for layer in range(5)] == [
        0,
        latent + indexer,
        2 * latent + indexer,
        3 * latent + 2 * indexer,
        4 * latent + 2 * indexer,
    ]
    assert spec.page_bytes == 4 * latent + 2 * indexer
    assert spec.block_offset(0, 3) == 3 * latent + 2 * indexer
    with pytest.raises(LayoutError, match="layer_block_bytes"):
        _ = spec.block_bytes


def test_a_pp_rank_owns_one_contiguous_run():
    spec = glm_spec()
    runs = []
    for rank in ParallelConfig(tp=2, pp=2).all_ranks():
        rect = rank_rectangle(spec, rank)
        assert rect.num_bytes(spec) == sum(length for _, length in rect.byte_runs(spec))
        if rect.writer:
            runs.extend(rect.byte_runs(spec))
    # Exactly one replica of the single latent head writes; the two stages tile the page.
    assert sorted(runs) == [(0, spec.layer_offset(2)), (spec.layer_offset(2), spec.layer_offset(2))]
    assert sum(length for _, length in runs) == spec.page_bytes


@pytest.mark.parametrize(
    "change",
    [
        {"index_topk": 32},
        {"index_layers": (0, 1)},
        {"index_head_dim": 16},
        {"index_dtype": "bfloat16"},
        {"rope_head_dim": 8},
        {"k_head_dim": 40},
        {"kv_dtype": "float32"},
    ],
)
def test_every_width_dtype_and_pattern_is_in_the_namespace(change):
    assert glm_spec(**change).namespace() != glm_spec().namespace()


def test_index_dtype_defaults_to_the_kv_dtype_in_bytes_and_name():
    implicit = glm_spec(index_dtype=None)
    explicit = glm_spec(index_dtype="bfloat16")
    assert implicit.namespace() == explicit.namespace()
    assert implicit.index_row_bytes == 32 * 2


def test_specs_without_an_indexer_keep_their_namespace():
    plain = glm_spec(index_head_dim=0, index_dtype=None, index_layers=(), index_topk=0)
    assert plain.uniform and plain.block_bytes == 16 * 48 * 2
    assert "index_layers" not in plain.identity_fields()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"index_layers": (2, 0)}, "increasing"),
        ({"index_layers": (4,)}, "increasing"),
        ({"index_topk": 0}, "sparse-attention"),
        ({"index_head_dim": 0}, "sparse-attention"),
        ({"index_dtype": "int4"}, "index_dtype"),
        ({"rope_head_dim": 48}, "rope_head_dim"),
        ({"index_layers": [0, 2]}, "tuple"),
    ],
)
def test_bad_sparse_fields_are_refused(fields, message):
    with pytest.raises(LayoutError, match=message):
        glm_spec(**fields)


def test_indexer_keys_need_mla():
    with pytest.raises(LayoutError, match="MLA"):
        ModelKVSpec(
            model_id="m",
            weights_fingerprint="",
            num_layers=2,
            num_kv_heads=2,
            k_head_dim=8,
            v_head_dim=8,
            kv_dtype="float32",
            index_head_dim=8,
            index_layers=(0,),
            index_topk=4,
        )


def test_a_draft_page_carries_its_own_indexer_fields():
    target = glm_spec()
    draft = target.draft_spec(
        model_id="glm_moe_dsa:tiny:mtp",
        weights_fingerprint="sha256:00",
        num_layers=1,
        num_kv_heads=1,
        k_head_dim=48,
        v_head_dim=0,
        attention_kind="mla",
        rope_head_dim=16,
        index_head_dim=32,
        index_dtype="float32",
        index_layers=(0,),
        index_topk=64,
    )
    assert draft.page_bytes == 16 * 48 * 2 + 16 * 32 * 4
    assert draft.target_namespace == target.namespace()
