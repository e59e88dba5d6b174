"""A GLM-5-shaped model (MLA, DeepSeek sparse attention with a shared layer,
MoE) served by the whole system: control, a cache server, prefill and decode
pools, real processes on loopback, driven over HTTP. Tokens are compared
with `kvrelay generate` in one process (float64).

The pages the tier serves are complete: the test writes a prompt's pages
into the tier itself, once intact and once with the indexer keys zeroed;
intact pages give the cold run's tokens, zeroed indexer keys change them (the
indexer then picks other tokens for every query: prompts are longer than
`index_topk`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.demo.cluster import ClusterConfig, LocalCluster, PoolConfig
from kvrelay.layout import ParallelConfig, rank_rectangle
from kvrelay.model.cross_config import prefix_unified_pages
from kvrelay.model.loader import model_kv_spec
from kvrelay.transfer import create_agent

# The cluster test's helpers: `kvrelay generate` in one process (float64,
# page 16) and the completion calls.
from tests.integration.test_cluster import (
    DTYPE,
    PAGE,
    cached,
    complete,
    generate,
    rng_tokens,
    tokens_of,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def glm5_dir(tmp_path_factory):
    from kvrelay.model.make_mla_model import MlaModelSpec, write_mla_model

    # Layer 2 shares layer 1's top-k (index_topk_freq 2); index_topk 32.
    spec = MlaModelSpec(arch="glm5", layers=3, index_topk_freq=2, std=0.2, seed=21)
    return write_mla_model(tmp_path_factory.mktemp("glm5") / "model", spec)


@pytest.fixture(scope="module")
def cluster(glm5_dir, tmp_path_factory):
    page_bytes = model_kv_spec(glm5_dir, DTYPE, PAGE).page_bytes
    config = ClusterConfig(
        model_dir=glm5_dir, log_dir=tmp_path_factory.mktemp("logs"), prefill=PoolConfig(tp=2),
        decode=PoolConfig(tp=1), page_bytes=page_bytes, page_size=PAGE, dtype=DTYPE,
        prefill_pages=256, decode_pages=256, cache_gb=0.05,
    )  # fmt: skip
    started = LocalCluster(config).start()
    try:
        yield started
    finally:
        started.stop()


def test_turns_hit_and_a_redeploy_under_another_shape_hits(cluster, glm5_dir):
    url = cluster.control_url
    p1 = rng_tokens(1, 150)
    a1 = complete(url, p1, 12)
    assert tokens_of(a1) == generate(glm5_dir, p1, 12)

    # Turn 2: the conversation so far is served (prefill's pool and the tier,
    # where decode wrote the answer's pages).
    p2 = p1 + tokens_of(a1) + rng_tokens(2, 40)
    a2 = complete(url, p2, 10)
    assert tokens_of(a2) == generate(glm5_dir, p2, 10)
    local, tier = cached(a2)
    assert local + tier >= (len(p1) + 12 - 1) // PAGE * PAGE
    assert tier > 0  # pages past the prompt exist only as decode's write-back

    # Redeploy: prefill PP=2 and decode TP=2, new processes with empty pools.
    cluster.redeploy("prefill", PoolConfig(tp=1, pp=2))
    cluster.redeploy("decode", PoolConfig(tp=2))
    p3 = p2 + tokens_of(a2) + rng_tokens(3, 40)
    a3 = complete(url, p3, 10)
    assert tokens_of(a3) == generate(glm5_dir, p3, 10)
    local, tier = cached(a3)
    assert local == 0 and tier == (len(p2) + 10 - 1) // PAGE * PAGE


async def _write_pages(cluster, spec, prompt: list[int], pages: torch.Tensor) -> int:
    agent = await create_agent("tcp", token=cluster.config.token)
    pb = spec.page_bytes
    config = CacheClientConfig(tuple(cluster.cache_addresses), cluster.config.token)
    client = CacheClient(agent, spec, rank_rectangle(spec, ParallelConfig()), config)
    try:
        local = agent.allocate_arena(pages.size(0) * pb)
        local.tensor.copy_(pages.reshape(-1))
        keys = spec.page_keys(prompt)[: pages.size(0)]
        return await client.write(keys, local, [i * pb for i in range(len(keys))])
    finally:
        await client.close()
        await agent.close()


def zero_indexer_keys(spec, pages: torch.Tensor) -> torch.Tensor:
    out = pages.clone()
    for layer in spec.index_layers:
        start = spec.layer_offset(layer) + spec.page_size * spec.k_row_bytes
        out[:, start : start + spec.page_size * spec.index_row_bytes] = 0
    return out


@pytest.mark.parametrize("intact", [True, False], ids=["intact", "indexer-keys-zeroed"])
def test_a_served_page_is_complete(cluster, glm5_dir, intact):
    spec = model_kv_spec(glm5_dir, DTYPE, PAGE)
    prompt = rng_tokens(10 if intact else 11, 130)
    full = len(prompt) // PAGE
    pages, _ = prefix_unified_pages(glm5_dir, ParallelConfig(), prompt, dtype=DTYPE,
                                    page_size=PAGE)  # fmt: skip
    pages = pages[:full]
    served = pages if intact else zero_indexer_keys(spec, pages)
    assert asyncio.run(_write_pages(cluster, spec, prompt, served)) == full
    answer = complete(cluster.control_url, prompt, 10)
    local, tier = cached(answer)
    assert local == 0 and tier == full * PAGE
    cold = generate(glm5_dir, prompt, 10)
    if intact:
        assert tokens_of(answer) == cold
    else:
        assert tokens_of(answer) != cold
