"""MLA pages shared between SGLang ranks (through the adapter) and kvrelay's
runner, position by position, for a DeepSeek-V3-shaped model.

kvrelay's runner (`load_engine`, `--key-scheme sglang`) computes a prompt's
latent rows; SGLang TP=2 ranks (`MLATokenToKVPoolHost`, TP rank 0 the
storage writer) hold the same rows and write them with SGLang's own page
keys. The adapter's namespace is the runner's (model identity, latent and
RoPE widths, dtype, page size, key scheme), kvrelay's cache client keying
the prompt from its token ids reads SGLang's pages byte for byte, a fresh
runner continues from them as from its own cold run, and SGLang PP=2 ranks
read pages the runner wrote. A GLM-5 (DSA) model's pages are another
namespace on the two sides: SGLang keeps indexer keys quantized.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from kvrelay.adapters.sglang.config import AdapterConfig
from kvrelay.adapters.sglang.harness import PoolName, dsa_indexer_pool
from kvrelay.adapters.sglang.identity import rope_to_pairs
from kvrelay.adapters.sglang.storage_v2 import TierRoutes
from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.mla_loader import mla_config_from_dir, mla_kv_spec
from kvrelay.model.page_export import export_prefix, import_prefix
from tests.adapters import sglang_env as env
from tests.adapters.pages import read_page, write_page
from tests.model.mla_support import MlaModelDirs

PAGE, FULL, NEW = 16, 4, 8
DTYPE = "float32"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return MlaModelDirs(tmp_path_factory.mktemp("mla-runner"))


@pytest.fixture
def opened():
    backends = []
    yield backends
    for backend in backends:
        backend.close()


def _prompt() -> list[int]:
    g = torch.Generator().manual_seed(21)
    return torch.randint(0, 200, (FULL * PAGE + 5,), generator=g).tolist()


def _backend(opened, servers, spec, config, layout, *, tp=1, tp_rank=0, pp=1, pp_rank=0):
    layers = spec.num_layers // pp
    l0 = pp_rank * layers
    pool = env.mla_pool(layout, layers=layers, start_layer=l0, page_size=PAGE,
                        width=spec.k_head_dim, dtype=getattr(torch, DTYPE),
                        rope=config.qk_rope_head_dim, device_tokens=8 * PAGE)  # fmt: skip
    identity = {"model_id": spec.model_id, "weights_fingerprint": spec.weights_fingerprint,
                "num_layers": spec.num_layers}  # fmt: skip
    extra = env.dynamic_extra(servers, **identity)
    storage = env.storage_config(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, mla=True,
                                 layout=layout, extra=extra)  # fmt: skip
    backend = env.create_backend(storage, pool)
    opened.append(backend)
    return backend, pool, (l0, l0 + layers)


async def read_with_worker_keys(servers, spec, prompt) -> tuple[int, torch.Tensor]:
    """kvrelay's cache client keying `prompt` from token ids, as the workers do."""
    from kvrelay.cache.client import CacheClient, CacheClientConfig
    from kvrelay.layout import Rectangle
    from kvrelay.transfer import create_agent

    keys = spec.page_keys(prompt)
    agent = await create_agent("tcp", token=env.TOKEN)
    arena = agent.allocate_arena(len(keys) * spec.page_bytes)
    client = CacheClient(agent, spec, Rectangle(0, 1, 0, spec.num_layers),
                         CacheClientConfig(servers=tuple(servers), token=env.TOKEN))  # fmt: skip
    try:
        found = await client.lookup(keys, arena, [i * spec.page_bytes for i in range(len(keys))])
        return found, arena.tensor[: len(keys) * spec.page_bytes].view(len(keys), -1).clone()
    finally:
        await client.close()
        await agent.close()


def _rows(pages: torch.Tensor, spec) -> torch.Tensor:
    """Unified MLA pages [page, bytes] -> [page, layer, token, width], the RoPE
    part as SGLang's cache holds it (DeepSeek's interleaved pairs)."""
    dtype = getattr(torch, DTYPE)
    rows = pages.view(dtype).view(len(pages), spec.num_layers, PAGE, spec.k_head_dim).clone()
    rope_to_pairs(rows, spec.rope_head_dim)
    return rows


def test_deepseek_v3_pages_shared_with_kvrelays_runner(models, opened):
    model_dir = models("deepseek_v3")
    config = mla_config_from_dir(model_dir)
    spec = mla_kv_spec(model_dir, config, DTYPE, PAGE, key_scheme="sglang")
    prompt = _prompt()
    cold = load_engine(model_dir, dtype=DTYPE, page_size=PAGE, num_pages=32, key_scheme="sglang")
    want = cold.generate([Request(prompt, SamplingParams(NEW))])[0].tokens
    source = torch.zeros(FULL, spec.page_bytes, dtype=torch.uint8)
    assert export_prefix(cold, prompt[: FULL * PAGE], source) == FULL
    del cold
    servers = [env.CacheServerProcess(spec.page_bytes) for _ in range(2)]
    try:
        keys = env.sglang_keys(prompt[: FULL * PAGE], PAGE)
        rows = _rows(source, spec)
        # SGLang TP=2: both ranks hold the latent rows, rank 0 writes them.
        for rank in range(2):
            backend, pool, _ = _backend(opened, servers, spec, config, "page_first",
                                        tp=2, tp_rank=rank)  # fmt: skip
            assert backend.namespace == spec.namespace()  # the runner's namespace
            idx = pool.alloc(FULL * PAGE)
            for p in range(FULL):  # [layer, token, head, width]
                write_page(pool, int(idx[p * PAGE]), rows[p].unsqueeze(2))
            assert backend.batch_set_v1(keys, idx) == [True] * FULL
        addresses = [s.address for s in servers]
        found, pages = asyncio.run(read_with_worker_keys(addresses, spec, prompt))
        assert found == FULL and torch.equal(pages, source)  # position by position

        # A fresh runner continues from SGLang's pages as from its own cold run.
        warm = load_engine(model_dir, dtype=DTYPE, page_size=PAGE, num_pages=32,
                           key_scheme="sglang")  # fmt: skip
        assert import_prefix(warm, prompt[: FULL * PAGE], pages) == FULL
        out = warm.generate([Request(prompt, SamplingParams(NEW))])[0]
        assert out.tokens == want and out.cached_tokens == FULL * PAGE

        # SGLang PP=2 stages read them back, each its layers.
        for pp_rank in range(2):
            stage = _backend(opened, servers, spec, config, "page_first_direct", pp=2,
                             pp_rank=pp_rank)  # fmt: skip
            backend, pool, (l0, l1) = stage
            idx = pool.alloc(FULL * PAGE)
            assert backend.batch_exists(keys) == FULL
            assert backend.batch_get_v1(keys, idx) == [True] * FULL
            for p in range(FULL):
                got = read_page(pool, int(idx[p * PAGE]))[:, :, 0]
                assert torch.equal(got, rows[p, l0:l1]), (pp_rank, p)
    finally:
        for server in servers:
            server.stop()


def test_glm5_pages_are_another_namespace_on_sglang(models):
    """The runner keeps indexer keys in the model dtype, SGLang in fp8 with
    scales: the same model's DSA pages do not mix (a miss, never a wrong hit)."""
    model_dir = models("glm5")
    config = mla_config_from_dir(model_dir)
    spec = mla_kv_spec(model_dir, config, DTYPE, 64, key_scheme="sglang")
    pool = env.mla_pool("page_first", layers=spec.num_layers, start_layer=0, page_size=64,
                        width=spec.k_head_dim, dtype=torch.float32,
                        rope=config.qk_rope_head_dim, device_tokens=512)  # fmt: skip
    skip = [i for i in range(spec.num_layers) if i not in spec.index_layers]
    extra = env.dynamic_extra([SimpleNamespace(address="127.0.0.1:1")], model_id=spec.model_id,
                              weights_fingerprint=spec.weights_fingerprint,
                              index_topk=config.index_topk)  # fmt: skip
    backend = SimpleNamespace(
        config=AdapterConfig.from_extra_config(extra),
        storage_config=env.storage_config(mla=True, layout="page_first", extra=extra),
        mem_pool_host=pool,
        named_pools={PoolName.INDEXER.value: dsa_indexer_pool(pool, skip=skip, device_tokens=512)},
    )  # fmt: skip
    sglang = TierRoutes(backend).spec
    assert (sglang.index_layers, sglang.index_topk) == (spec.index_layers, spec.index_topk)
    assert sglang.rope_head_dim == spec.rope_head_dim and sglang.k_head_dim == spec.k_head_dim
    assert sglang.index_dtype == "uint8" and spec.index_dtype in (None, DTYPE)
    assert sglang.namespace() != spec.namespace()
