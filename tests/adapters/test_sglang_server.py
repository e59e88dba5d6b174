"""Real SGLang server processes (CPU engine, HiCache) with kvrelay as their L3.

One kvrelay cache server (`kvrelay launch cache`, a file L3 written through,
on a fixed port so that a restart keeps its address) serves the module. The
SGLang server runs through `kvrelay.adapters.sglang.cpu.launch_server` with
`--hicache-storage-backend dynamic` and the README's extra config, its model
identity that of kvrelay's own workers for the same weights (`--key-scheme
sglang`), so that both engines name the same pages. One SGLang server runs at
a time: 2 cores.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import torch

from kvrelay.adapters.sglang.cpu.server import SGLangServer, free_port, kvrelay_extra
from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.cache.launch import CacheServerProcess
from kvrelay.layout import Rectangle
from kvrelay.model import Request, SamplingParams, load_engine, write_model
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec
from kvrelay.model.page_export import export_prefix
from kvrelay.transfer import create_agent
from tests.serving import fake_control as fc
from tests.serving.conftest import Process
from tests.support.models import TINY, prompt_tokens

PAGE = 16
DTYPE = "bfloat16"
PROMPT = 3000  # tokens: 187 full pages
NEW = 8
TOKEN = fc.TOKEN
WAIT_S = 60.0

# What each test leaves for the next (greedy outputs of cold runs).
seen: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = write_model(tmp_path_factory.mktemp("sglang") / "llama", TINY["serving"])
    spec = kv_spec(model_dir, ModelConfig.from_dir(model_dir), DTYPE, PAGE, key_scheme="sglang")
    return model_dir, spec


class Tier:
    """The module's cache server, restartable on the same address."""

    def __init__(self, spec, l3_dir) -> None:
        self.spec, self.l3_dir = spec, l3_dir
        self.listen = f"127.0.0.1:{free_port()}"
        self.server: CacheServerProcess | None = None
        self.start()

    def start(self) -> None:
        self.server = CacheServerProcess(
            "--l3", f"file:{self.l3_dir}", "--l3-policy", "write-through",
            "--l3-gb", "0.5", token=TOKEN, page_bytes=self.spec.page_bytes, pages=1024,
            listen=self.listen,
        )  # fmt: skip

    def kill(self) -> None:
        self.server.stop(signal.SIGKILL)

    async def _read(self, tokens) -> tuple[int, torch.Tensor]:
        spec = self.spec
        keys = spec.page_keys(tokens)
        agent = await create_agent("tcp", token=TOKEN)
        arena = agent.allocate_arena(len(keys) * spec.page_bytes)
        rect = Rectangle(0, spec.num_kv_heads, 0, spec.num_layers)
        config = CacheClientConfig(servers=(self.listen,), token=TOKEN, timeout_s=10.0)
        client = CacheClient(agent, spec, rect, config)
        try:
            bases = [i * spec.page_bytes for i in range(len(keys))]
            found = await client.lookup(keys, arena, bases)
            pages = arena.tensor[: len(keys) * spec.page_bytes].view(len(keys), -1).clone()
            return found, pages
        finally:
            await client.close()
            await agent.close()

    async def _l3_stats(self) -> dict:
        agent = await create_agent("tcp", token=TOKEN)
        rect = Rectangle(0, self.spec.num_kv_heads, 0, self.spec.num_layers)
        config = CacheClientConfig(servers=(self.listen,), token=TOKEN, timeout_s=10.0)
        client = CacheClient(agent, self.spec, rect, config)
        try:
            return (await client.server_stats())[self.listen]["l3"]
        finally:
            await client.close()
            await agent.close()

    def l3_stats(self) -> dict:
        return asyncio.run(self._l3_stats())

    def read(self, tokens) -> tuple[int, torch.Tensor]:
        """Full pages of `tokens` found in the tier (keyed as kvrelay's workers
        key them), and their bytes."""
        return asyncio.run(self._read(tokens))

    def wait_pages(self, tokens, want: int) -> None:
        """Until the tier holds the first `want` pages of `tokens` (SGLang
        backs pages up after it answers)."""
        deadline = time.monotonic() + WAIT_S
        while (found := self.read(tokens)[0]) < want:
            assert time.monotonic() < deadline, f"{found} of {want} pages reached the tier"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def tier(model, tmp_path_factory):
    tier = Tier(model[1], tmp_path_factory.mktemp("l3"))
    yield tier
    tier.server.stop()


def sglang_server(model, tier, tmp_path_factory, layout, tp=1) -> SGLangServer:
    model_dir, spec = model
    identity = {"model_id": spec.model_id, "weights_fingerprint": spec.weights_fingerprint}
    extra = kvrelay_extra([tier.listen], TOKEN, timeout_s=3.0, **identity)
    log = tmp_path_factory.mktemp("logs") / f"sglang-{layout}-tp{tp}.log"
    return SGLangServer(model_dir, log, extra=extra, layout=layout, page_size=PAGE,
                        dtype=DTYPE, tp=tp).start()  # fmt: skip


@pytest.fixture(scope="module")
def sglang(model, tier, tmp_path_factory):
    server = sglang_server(model, tier, tmp_path_factory, "layer_first")
    yield server
    server.stop()


def full_pages(tokens) -> int:
    return len(tokens) // PAGE


def assert_from_storage(reply, tokens) -> None:
    assert reply.storage_tokens >= 0.95 * len(tokens), reply
    assert reply.storage_tokens == full_pages(tokens) * PAGE - (len(tokens) % PAGE == 0) * PAGE


def test_prompt_is_served_from_kvrelay_after_a_flush(sglang, tier):
    prompt = prompt_tokens(PROMPT, seed=101)
    cold = sglang.generate(prompt, NEW)
    assert cold.cached_tokens == 0 and len(cold.output_ids) == NEW
    tier.wait_pages(prompt, full_pages(prompt))
    sglang.flush()
    warm = sglang.generate(prompt, NEW)
    assert_from_storage(warm, prompt)
    assert warm.output_ids == cold.output_ids
    seen["p1"] = cold.output_ids


def kvrelay_kv(model_dir, prompt, dtype: str, pages: int) -> torch.Tensor:
    """kvrelay's KV of the prompt's first `pages` pages, computed in this
    process: [page, head, layer, kv, token, dim] as float32."""
    engine = load_engine(model_dir, dtype=dtype, page_size=PAGE, num_pages=256,
                         key_scheme="sglang")  # fmt: skip
    engine.generate([Request(prompt, SamplingParams(1))])
    spec = engine.spec
    arena = torch.zeros(full_pages(prompt) + 1, spec.page_bytes, dtype=torch.uint8)
    export_prefix(engine, prompt, arena)
    shape = (pages, spec.num_kv_heads, spec.num_layers, 2, PAGE, spec.k_head_dim)
    return arena[:pages].view(getattr(torch, dtype)).float().view(shape)


def assert_kv_within_rounding(model, prompt, pages: torch.Tensor, found: int) -> None:
    """Pages an SGLang server wrote against kvrelay's KV computed cold from the
    same weights, position by position. Two engines in bfloat16 round at
    different points, and the second layer sees the first's rounding; the
    measure of "equal to the dtype's rounding" is kvrelay's own bfloat16 KV's
    distance from its float32 KV, per layer, which SGLang's must not exceed
    by more than half again."""
    model_dir, spec = model
    truth = kvrelay_kv(model_dir, prompt, "float32", found)
    own = kvrelay_kv(model_dir, prompt, DTYPE, found)
    got = pages.view(torch.bfloat16).float().view(own.shape)
    for layer in range(spec.num_layers):
        theirs = (got[:, :, layer] - truth[:, :, layer]).abs()
        ours = (own[:, :, layer] - truth[:, :, layer]).abs()
        assert theirs.mean() <= 1.5 * ours.mean(), (layer, theirs.mean(), ours.mean())
        assert theirs.max() <= 1.5 * ours.max(), (layer, theirs.max(), ours.max())


def kvrelay_workers(model_dir, control, cache_address):
    common = ["--model", model_dir, "--control", control.url, "--token", TOKEN,
              "--backend", "tcp", "--num-pages", 256, "--page-size", PAGE, "--dtype", DTYPE,
              "--key-scheme", "sglang"]  # fmt: skip
    prefill = Process([str(a) for a in ["launch", "prefill", *common, "--cache", cache_address]])
    decode = Process([str(a) for a in ["launch", "decode", *common]])
    return prefill, decode


def test_pages_are_shared_with_kvrelay_workers_both_ways(model, sglang, tier):
    model_dir = model[0]
    prompt = prompt_tokens(PROMPT, seed=101)  # the previous test's: SGLang wrote its pages
    found, sglang_pages = tier.read(prompt)
    assert found == full_pages(prompt)
    # SGLang's KV against kvrelay's computed cold from the same weights.
    assert_kv_within_rounding(model, prompt, sglang_pages, found)

    control = fc.FakeControl()
    workers = []
    try:
        workers = list(kvrelay_workers(model_dir, control, tier.listen))
        prefill, decode = (w.info["address"] for w in workers)
        # SGLang's pages are a hit for kvrelay's workers...
        got = asyncio.run(fc.serve(prefill, decode, "s1", prompt, fc.params(NEW)))
        assert got["ok"], got
        assert got["prefill"]["cached_tokens"] == {"local": 0, "tier": found * PAGE}
        # ...and the pages kvrelay's workers write are a hit for SGLang.
        fresh = prompt_tokens(PROMPT, seed=202)
        assert tier.read(fresh)[0] == 0
        got = asyncio.run(fc.serve(prefill, decode, "s2", fresh, fc.params(NEW)))
        assert got["ok"], got
        tier.wait_pages(fresh, full_pages(fresh))
    finally:
        for worker in workers:
            worker.stop()
        control.close()
    reply = sglang.generate(fresh, NEW)
    assert_from_storage(reply, fresh)
    seen["p2_from_kvrelay_pages"] = reply.output_ids


def test_cache_server_faults_are_misses_and_corrupt_pages_are_never_served(sglang, tier):
    # Killed while SGLang runs: requests are served, from nothing stored.
    tier.kill()
    prompt = prompt_tokens(PROMPT // 2, seed=303)
    reply = sglang.generate(prompt, NEW)
    assert reply.storage_tokens == 0 and len(reply.output_ids) == NEW
    # Every page record on disk spoiled, then the server restarted on them:
    # its checksums refuse them, SGLang computes the prompt cold.
    spoiled = 0
    for path in tier.l3_dir.rglob("*.page"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        spoiled += 1
    assert spoiled >= 2 * full_pages(prompt)
    tier.start()
    fresh = prompt_tokens(PROMPT, seed=202)
    sglang.flush()
    cold = sglang.generate(fresh, NEW)
    assert cold.storage_tokens == 0
    assert tier.l3_stats()["checksum_failures"] >= 1  # the records were read, and refused
    # The output SGLang gave from kvrelay's workers' pages is its own cold one.
    assert cold.output_ids == seen.get("p2_from_kvrelay_pages")
    # Restarted, the tier takes pages again and hits come back.
    tier.wait_pages(fresh, full_pages(fresh))
    sglang.flush()
    warm = sglang.generate(fresh, NEW)
    assert_from_storage(warm, fresh)
    assert warm.output_ids == cold.output_ids
    seen["p2"] = cold.output_ids


def test_servers_of_other_host_layouts_and_tp2_share_the_pages(model, tier, sglang,
                                                                tmp_path_factory):  # fmt: skip
    """One server at a time (2 cores), each reading what a server of another
    shape wrote: layer_first (the module's server) -> page_first_direct
    (direct io) and page_first (kernel io) read its pages; page_first writes
    a new prompt's, which a TP=2 server reads; the TP=2 server writes
    another's, which a page_head server (kernel io) reads. Outputs are
    compared between servers of one TP size (TP=2 sums its row-parallel
    matmuls in another order); the KV TP=2 wrote is checked position by
    position."""
    sglang.stop()
    assert "p2" in seen, "needs the pages and output of the previous test"
    p2 = prompt_tokens(PROMPT, seed=202)
    p3, p4 = prompt_tokens(PROMPT, seed=404), prompt_tokens(PROMPT, seed=505)

    def serve(layout, tp=1):
        return sglang_server(model, tier, tmp_path_factory, layout, tp=tp)

    for layout in ("page_first_direct", "page_first"):
        server = serve(layout)
        try:
            reply = server.generate(p2, NEW)
            assert_from_storage(reply, p2)
            assert reply.output_ids == seen["p2"], layout
            if layout == "page_first":
                cold = server.generate(p3, NEW)
                assert cold.cached_tokens == 0
                tier.wait_pages(p3, full_pages(p3))
                seen["p3"] = cold.output_ids
        finally:
            server.stop()

    server = serve("layer_first", tp=2)
    try:
        reply = server.generate(p3, NEW)
        assert_from_storage(reply, p3)  # each rank read its head of TP=1's pages
        assert len(reply.output_ids) == NEW
        cold = server.generate(p4, NEW)
        assert cold.cached_tokens == 0
        tier.wait_pages(p4, full_pages(p4))  # sealed: both ranks wrote their heads
    finally:
        server.stop()
    found, pages = tier.read(p4)
    assert found == full_pages(p4)
    assert_kv_within_rounding(model, p4, pages, found)

    server = serve("page_head")
    try:
        reply = server.generate(p4, NEW)
        assert_from_storage(reply, p4)
        reply = server.generate(p3, NEW)
        assert_from_storage(reply, p3)
        assert reply.output_ids == seen["p3"]
    finally:
        server.stop()
