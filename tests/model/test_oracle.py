"""The runner against HF transformers (same weights, SDPA, float64): prefill
logits, logits after prefix reuse at page-aligned and unaligned lengths, and
32 greedy tokens, for Llama and Qwen2, GQA and MHA, page sizes 16 and 64."""

from dataclasses import replace

import pytest
import torch

from kvrelay.model import ModelConfig, Request, SamplingParams, load_engine
from kvrelay.model.rope import inverse_frequencies, rope_parameters
from tests.model.oracle import hf_greedy, hf_model
from tests.support.models import prompt_tokens

EXACT = 1e-9
NEW_TOKENS = 32
PROMPT = 150


def max_diff(a, b) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha", "qwen2-gqa", "qwen2-mha"])
def test_prefill_reuse_and_greedy_match_hf(model_dirs, name, page_size):
    model_dir = model_dirs(name)
    prompt = prompt_tokens(PROMPT, seed=page_size)
    oracle = hf_greedy(hf_model(model_dir), prompt, NEW_TOKENS)
    # Greedy output of a random model must not be a short loop (it would hide errors).
    assert len(set(oracle.tokens)) >= 16

    engine = load_engine(model_dir, dtype="float64", page_size=page_size, num_pages=64)
    cold = engine.generate([Request(prompt, SamplingParams(NEW_TOKENS), return_logits=True)])[0]
    assert cold.cached_tokens == 0
    assert max_diff(cold.prompt_logits, oracle.prompt_logits) < EXACT
    assert cold.tokens == oracle.tokens
    assert max_diff(torch.stack(cold.step_logits), torch.stack(oracle.step_logits)) < EXACT

    # Prefix reuse: a first request caches its pages (full ones, and its last
    # partial page); the full prompt then computes only the rest. Aligned
    # (2 pages) and unaligned prefix lengths.
    for prefix in (2 * page_size, page_size + 7, 2 * page_size + 1):
        if prefix >= PROMPT:
            continue
        engine.pool.clear_cache()
        engine.generate([Request(prompt[:prefix], SamplingParams(1))])
        warm = engine.generate([Request(prompt, SamplingParams(NEW_TOKENS), return_logits=True)])[0]
        assert warm.cached_tokens == prefix
        assert max_diff(warm.prompt_logits, oracle.prompt_logits[warm.cached_tokens :]) < EXACT
        assert warm.tokens == oracle.tokens
        assert max_diff(torch.stack(warm.step_logits), torch.stack(oracle.step_logits)) < EXACT
    assert engine.pool.free_pages == engine.pool.num_pages


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_embeddings": True, "shards": 3, "rope_theta": 500000.0},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"attention_bias": True, "mlp_bias": True},
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_fast": 16,
            }
        },
    ],
    ids=[
        "tied-sharded-theta",
        "rope-linear",
        "rope-llama3",
        "llama-biases",
        "rope-yarn",
        "rope-yarn-mscale",
    ],
)
def test_llama_variants_match_hf(model_dirs, overrides):
    model_dir = model_dirs("llama-gqa", **overrides)
    config = ModelConfig.from_dir(model_dir)
    if "rope_scaling" in overrides:
        # The scaling is read (not silently ignored by both sides).
        assert config.rope_type == overrides["rope_scaling"]["rope_type"]
        plain = inverse_frequencies(replace(config, rope_scaling=None))
        assert not torch.equal(inverse_frequencies(config), plain)
        if config.rope_type == "yarn":
            assert rope_parameters(config)[1] != 1.0
    if overrides.get("attention_bias"):
        assert config.qkv_bias and config.o_bias and config.mlp_bias
    prompt = prompt_tokens(100, seed=7)
    oracle = hf_greedy(hf_model(model_dir), prompt, 16)
    engine = load_engine(model_dir, dtype="float64", page_size=16, num_pages=32)
    got = engine.generate([Request(prompt, SamplingParams(16), return_logits=True)])[0]
    assert max_diff(got.prompt_logits, oracle.prompt_logits) < EXACT
    assert got.tokens == oracle.tokens


def test_float32_matches_hf_within_1e4(model_dirs):
    model_dir = model_dirs("qwen2-gqa")
    prompt = prompt_tokens(80, seed=8)
    oracle = hf_greedy(hf_model(model_dir, torch.float32), prompt, 8)
    engine = load_engine(model_dir, dtype="float32", page_size=16, num_pages=32)
    got = engine.generate([Request(prompt, SamplingParams(8), return_logits=True)])[0]
    assert got.prompt_logits.dtype == torch.float32
    assert max_diff(got.prompt_logits, oracle.prompt_logits) < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float64(model_dirs, dtype):
    model_dir = model_dirs("llama-gqa")
    prompt = prompt_tokens(40, seed=9)
    want = load_engine(model_dir, dtype="float64", page_size=16).generate(
        [Request(prompt, SamplingParams(1), return_logits=True)]
    )[0]
    got = load_engine(model_dir, dtype=dtype, page_size=16).generate(
        [Request(prompt, SamplingParams(1), return_logits=True)]
    )[0]
    assert got.prompt_logits.dtype == getattr(torch, dtype)
    scale = float(want.prompt_logits.abs().max())
    assert max_diff(got.prompt_logits, want.prompt_logits) < 0.05 * scale
