"""Hypothesis strategies for model KV specs and parallel configs that can run them."""

import itertools

from hypothesis import strategies as st

from kvrelay.layout import KV_DTYPE_ITEMSIZE, ModelKVSpec, ParallelConfig

# One small fixed spec for the key and layout tests.
TINY_SPEC = ModelKVSpec(
    model_id="llama-tiny",
    weights_fingerprint="w0",
    num_layers=4,
    num_kv_heads=2,
    k_head_dim=8,
    v_head_dim=8,
    kv_dtype="float32",
    page_size=4,
)


@st.composite
def kv_specs(draw, max_layers: int = 12, max_dim: int = 16, max_page: int = 16):
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    return ModelKVSpec(
        model_id=draw(st.sampled_from(["llama-tiny", "qwen2-tiny", "m"])),
        weights_fingerprint=draw(st.sampled_from(["", "abc", "def"])),
        num_layers=draw(st.integers(1, max_layers)),
        num_kv_heads=heads,
        k_head_dim=draw(st.integers(1, max_dim)),
        v_head_dim=0 if mla else draw(st.integers(1, max_dim)),
        kv_dtype=draw(st.sampled_from(sorted(KV_DTYPE_ITEMSIZE))),
        attention_kind="mla" if mla else "mha",
        page_size=draw(st.integers(1, max_page)),
        salt=draw(st.sampled_from(["", "tenant-a"])),
    )


@st.composite
def parallel_configs(draw, spec: ModelKVSpec):
    """Sizes valid for `spec` (rank 0); TP > heads replicates heads."""
    heads = spec.num_kv_heads
    tp_choices = [d for d in range(1, heads + 1) if heads % d == 0]
    tp_choices += [heads * r for r in (2, 3, 4) if heads * r <= 16]
    tp = draw(st.sampled_from(tp_choices))
    pp = draw(st.integers(1, min(spec.num_layers, 4)))
    split = None
    if pp > 1 and draw(st.booleans()):
        # A random uneven split: pp - 1 distinct cut points among the layers.
        cuts = sorted(
            draw(st.sets(st.integers(1, spec.num_layers - 1), min_size=pp - 1, max_size=pp - 1))
        )
        bounds = [0, *cuts, spec.num_layers]
        split = tuple(b - a for a, b in itertools.pairwise(bounds))
    cp = draw(st.integers(1, 3))
    return ParallelConfig(tp=tp, pp=pp, cp=cp, pp_layer_split=split)
