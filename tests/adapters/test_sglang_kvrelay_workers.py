"""Pages SGLang ranks write through the adapter are a full hit for kvrelay's own
workers from token ids (`--key-scheme sglang`, same model identity and dtype).

Two real `MHATokenToKVPoolHost` pools, SGLang TP=2 ranks, hold the prompt's KV
as kvrelay's model computes it (one process, the reference) and write it with
SGLang's own page keys (`get_hash_str`) through `batch_set_v1`. A kvrelay
prefill worker (TP=1, a process of its own) then finds every full page in the
tier from the prompt's token ids and a decode worker generates the reference's
tokens; kvrelay's cache client, keying the prompt with the worker's spec,
reads the pages back byte for byte."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvrelay.model import Request, SamplingParams, load_engine, write_model
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec
from kvrelay.model.page_export import export_prefix
from tests.adapters import sglang_env as env
from tests.adapters.pages import write_page
from tests.serving import fake_control as fc
from tests.serving.conftest import DTYPE, PAGE, Process, cache_args, worker_args
from tests.support.models import TINY, prompt_tokens

FULL = 4  # full pages of the prompt
NEW = 8


@pytest.fixture
def processes():
    started: list[Process] = []
    yield started
    for process in reversed(started):
        process.stop()


def unified_to_canonical(pages: torch.Tensor, spec) -> torch.Tensor:
    """[page, bytes] unified pages -> [page, kv, layer, token, head, dim] elements."""
    heads, layers, dim = spec.num_kv_heads, spec.num_layers, spec.k_head_dim
    values = pages.view(torch.float64).view(len(pages), heads, layers, 2, PAGE, dim)
    return values.permute(0, 3, 2, 4, 1, 5)


def sglang_tp2_write(servers, spec, truth, keys) -> None:
    """SGLang's TP=2 ranks, one KV head each, write every page of `truth`."""
    identity = {"model_id": spec.model_id, "weights_fingerprint": spec.weights_fingerprint,
                "token": fc.TOKEN}  # fmt: skip
    extra = env.dynamic_extra([SimpleNamespace(address=s) for s in servers], **identity)
    backends = []
    try:
        for rank in range(2):
            pool = env.mha_pool("page_first", heads=1, layers=spec.num_layers, start_layer=0,
                                page_size=PAGE, head_dim=spec.k_head_dim,
                                dtype=torch.float64)  # fmt: skip
            config = env.storage_config(tp=2, tp_rank=rank, layout="page_first", extra=extra,
                                        model_name="llama-served-by-sglang")  # fmt: skip
            backend = env.create_backend(config, pool)
            backends.append(backend)
            assert backend.namespace == spec.namespace()  # the worker's namespace
            indices = pool.alloc(len(keys) * PAGE)
            for i in range(len(keys)):
                write_page(pool, int(indices[i * PAGE]), truth[i, :, :, :, rank : rank + 1])
            assert backend.batch_set_v1(keys, indices) == [True] * len(keys)
        assert backends[0].batch_exists(keys) == len(keys)
    finally:
        for backend in backends:
            backend.close()


async def read_with_worker_keys(servers, spec, prompt) -> tuple[int, torch.Tensor]:
    from kvrelay.cache.client import CacheClient, CacheClientConfig
    from kvrelay.layout import Rectangle
    from kvrelay.transfer import create_agent

    keys = spec.page_keys(prompt)  # from token ids, as the workers key them
    agent = await create_agent("tcp", token=fc.TOKEN)
    arena = agent.allocate_arena(len(keys) * spec.page_bytes)
    client = CacheClient(agent, spec, Rectangle(0, spec.num_kv_heads, 0, spec.num_layers),
                         CacheClientConfig(servers=tuple(servers), token=fc.TOKEN))  # fmt: skip
    try:
        found = await client.lookup(keys, arena, [i * spec.page_bytes for i in range(len(keys))])
        return found, arena.tensor[: len(keys) * spec.page_bytes].view(len(keys), -1).clone()
    finally:
        await client.close()
        await agent.close()


def test_sglang_tp2_pages_are_a_full_hit_for_kvrelay_workers(tmp_path, processes):
    model_dir = write_model(tmp_path / "llama", TINY["serving"])
    spec = kv_spec(model_dir, ModelConfig.from_dir(model_dir), DTYPE, PAGE, key_scheme="sglang")
    prompt = prompt_tokens(FULL * PAGE + 5, seed=16)
    # The reference: one process, kvrelay's own keys; its pages are the truth.
    engine = load_engine(model_dir, dtype=DTYPE, page_size=PAGE, num_pages=32)
    want = engine.generate([Request(prompt, SamplingParams(NEW))])[0].tokens
    source = torch.zeros(FULL, spec.page_bytes, dtype=torch.uint8)
    assert export_prefix(engine, prompt[: FULL * PAGE], source) == FULL
    del engine

    def start(*args):
        processes.append(Process([str(a) for a in args]))
        return processes[-1].info

    servers = [start(*cache_args(spec.page_bytes))["listen"] for _ in range(2)]
    # SGLang's own hash of the prompt's full pages (it stores only full pages).
    keys = env.sglang_keys(prompt[: FULL * PAGE], PAGE)
    assert len(keys) == FULL
    sglang_tp2_write(servers, spec, unified_to_canonical(source, spec), keys)

    found, pages = asyncio.run(read_with_worker_keys(servers, spec, prompt))
    assert found == FULL and torch.equal(pages, source)
    # kvrelay's own key scheme names other keys (and another namespace): no hit.
    kvrelay_keys = replace(spec, key_scheme="kvrelay")
    assert asyncio.run(read_with_worker_keys(servers, kvrelay_keys, prompt))[0] == 0

    control = fc.FakeControl()
    try:
        sglang = ["--key-scheme", "sglang"]
        prefill = start(*worker_args("prefill", model_dir, control, cache=servers, extra=sglang))
        decode = start(*worker_args("decode", model_dir, control, extra=sglang))
        assert control.nodes[prefill["node_id"]]["key_scheme"] == "sglang"
        got = asyncio.run(
            fc.serve(prefill["address"], decode["address"], "s1", prompt, fc.params(NEW))
        )
        assert got["ok"], got
        assert got["prefill"]["cached_tokens"] == {"local": 0, "tier": FULL * PAGE}
        assert got["tokens"] == want
    finally:
        for process in processes[2:]:
            process.stop()
        control.close()
