"""GLM-5, DeepSeek-V3.2 and DeepSeek-V3 on the runner against transformers in
float64: prompt logits and greedy tokens cold, after a cached prefix (full
pages and a partial one) and with chunked prefill, page sizes 16 and 64,
prompts longer than index_topk so the indexer decides what attention sees.

Greedy tokens are equal; logits agree to 1e-6, not to float64 rounding: the
router's sigmoid and the indexer's scores are float32 in both (as the models
define them), and float32 results depend on the shape of the call (a
vectorised loop's tail, a GEMM's blocking). transformers itself rounds a
row differently in its prefill and in its decode; a chunk or a suffix after
a cached prefix is yet another shape."""

import pytest
import torch

from kvrelay.model import Request, SamplingParams, load_engine
from tests.model.mla_support import ARCHS, hf_mla_model
from tests.model.oracle import hf_greedy
from tests.support.models import prompt_tokens

CLOSE = 1e-6
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
