"""GLM-5, DeepSeek-V3.2 and DeepSeek-V3 on the runner against transformers in
float64: prompt logits and greedy tokens cold, after a cached prefix (full
pages and a partial one) and with chunked prefill, page sizes 16 and 64,
prompts longer than index_topk so the indexer decides what attention sees.

Greedy tokens are equal; logits agree to 1e-5, not to float64 rounding: the
router's sigmoid and the indexer's scores are float32 in both (as the models
define them), and float32 results depend on the shape of the call (a
vectorised loop's tail, a GEMM's blocking). transformers itself rounds a
row differently in its prefill and in its decode; a chunk or a suffix after
a cached prefix is yet another shape."""

import pytest
import torch

from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.loader import load_config
from tests.model.mla_support import ARCHS, hf_mla_model
from tests.model.oracle import hf_greedy
from tests.support.models import prompt_tokens

CLOSE = 1e-5
NEW = 16


def max_diff(a, b) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("arch", ARCHS)
def test_mla_models_match_hf_cold_chunked_and_after_a_cached_prefix(mla_dirs, arch, page_size):
    model_dir = mla_dirs(arch)
    prompt = prompt_tokens(150 if page_size == 16 else 200, seed=page_size + len(arch))
    oracle = hf_greedy(hf_mla_model(model_dir), prompt, NEW)
    assert len(set(oracle.tokens)) >= NEW // 2

    # Chunks of 48 tokens: each later chunk reads the earlier ones from the pool.
    engine = load_engine(
        model_dir, dtype="float64", page_size=page_size, num_pages=32, max_prefill_tokens=48
    )
    cold = engine.generate([Request(prompt, SamplingParams(NEW), return_logits=True)])[0]
    assert cold.cached_tokens == 0
    assert max_diff(cold.prompt_logits, oracle.prompt_logits) < CLOSE
    assert cold.tokens == oracle.tokens
    assert max_diff(torch.stack(cold.step_logits), torch.stack(oracle.step_logits)) < CLOSE

    for prefix in (2 * page_size, page_size + 7):
        engine.pool.clear_cache()
        engine.generate([Request(prompt[:prefix], SamplingParams(1))])
        warm = engine.generate([Request(prompt, SamplingParams(NEW), return_logits=True)])[0]
        assert warm.cached_tokens == prefix
        assert max_diff(warm.prompt_logits, oracle.prompt_logits[prefix:]) < CLOSE
        assert warm.tokens == oracle.tokens
    assert engine.pool.free_pages == engine.pool.num_pages


@pytest.mark.parametrize("arch", ["glm5", "deepseek_v32"])
def test_the_indexer_keys_in_the_pool_decide_the_tokens(mla_dirs, arch):
    """Zeroing the cached prefix's indexer keys changes the tokens (the pages
    carry state attention depends on), and a dense model (index_topk above
    the prompt) generates other tokens than the sparse one."""
    model_dir = mla_dirs(arch)
    prompt = prompt_tokens(160, seed=3)
    engine = load_engine(model_dir, dtype="float64", page_size=16, num_pages=32)
    want = engine.generate([Request(prompt, SamplingParams(NEW))])[0].tokens
    for zero_keys in (False, True):
        engine.pool.clear_cache()
        engine.generate([Request(prompt[:128], SamplingParams(1))])
        if zero_keys:  # the cached pages' indexer keys only; their latents stay
            engine.pool.index_storage.zero_()
        hit = engine.generate([Request(prompt, SamplingParams(NEW))])[0]
        assert hit.cached_tokens == 128
        assert (hit.tokens == want) != zero_keys

    dense = load_engine(mla_dirs(arch, index_topk=1024), dtype="float64", page_size=16)
    assert dense.generate([Request(prompt, SamplingParams(NEW))])[0].tokens != want


YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("glm5", {"rope_scaling": YARN, "shards": 3}),
        ("deepseek_v32", {"attention_bias": True, "tie_embeddings": True}),
        ("deepseek_v3", {"q_lora_rank": 48, "rope_interleave": False, "rope_scaling": YARN}),
        ("deepseek_v3", {"attention_bias": True, "groups": 4, "topk_groups": 2}),
    ],
    ids=["glm5-yarn-sharded", "v32-bias-tied", "v3-qlora-halfsplit-yarn", "v3-bias-groups"],
)
def test_mla_variants_match_hf(mla_dirs, arch, overrides):
    """yarn (its mscale in the softmax scale and the rotary tables), q LoRA or
    plain q_proj, half-split MLA RoPE (V3's rope_interleave false), biases,
    tied embeddings, sharded checkpoints, other expert groupings."""
    model_dir = mla_dirs(arch, **overrides)
    prompt = prompt_tokens(120, seed=5)
    hf = hf_mla_model(model_dir)
    if "rope_scaling" in overrides:  # read by both sides, not ignored by both
        assert hf.config.rope_parameters["rope_type"] == "yarn"
        assert load_config(model_dir).rope_type == "yarn"
    oracle = hf_greedy(hf, prompt, NEW)
    engine = load_engine(model_dir, dtype="float64", page_size=16, num_pages=32)
    got = engine.generate([Request(prompt, SamplingParams(NEW), return_logits=True)])[0]
    assert max_diff(got.prompt_logits, oracle.prompt_logits) < CLOSE
    assert got.tokens == oracle.tokens


def test_float32_and_bfloat16_run_close_to_float64(mla_dirs):
    """float32 stays close to float64; bfloat16 weights and pool (the
    indexer's scores and the router still float32) run, on the whole close
    (a row whose routing flips at bfloat16 rounding may differ more)."""
    model_dir = mla_dirs("glm5")
    prompt = prompt_tokens(40, seed=9)
    want = (
        load_engine(model_dir, dtype="float64", page_size=16)
        .generate([Request(prompt, SamplingParams(1), return_logits=True)])[0]
        .prompt_logits
    )
    scale = float(want.abs().max())
    for dtype, tolerance in ((torch.float32, 1e-3), (torch.bfloat16, 0.05)):
        engine = load_engine(model_dir, dtype=str(dtype).removeprefix("torch."), page_size=16)
        assert engine.pool.index_storage.dtype == dtype
        got = engine.generate([Request(prompt, SamplingParams(1), return_logits=True)])[0]
        assert got.prompt_logits.dtype == dtype
        error = (got.prompt_logits.double() - want).abs()
        measure = error.max() if dtype == torch.float32 else error.mean()
        assert float(measure) < tolerance * scale


def test_a_batch_of_sequences_decodes_as_each_alone(mla_dirs):
    """Prefill and decode of sequences of different lengths in one batch (the
    router, indexer and attention per sequence), one of them sampled."""
    model_dir = mla_dirs("glm5")
    requests = [
        Request(prompt_tokens(170, seed=1), SamplingParams(NEW)),
        Request(prompt_tokens(60, seed=2), SamplingParams(NEW, temperature=0.8, seed=3)),
        Request(prompt_tokens(101, seed=4), SamplingParams(NEW)),
    ]
    engine = load_engine(model_dir, dtype="float64", page_size=16, num_pages=64)
    alone = [engine.generate([r])[0].tokens for r in requests]
    engine.pool.clear_cache()
    assert [r.tokens for r in engine.generate(requests)] == alone
