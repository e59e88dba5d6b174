"""KvrelayConnector with real vLLM engines (CPU) and a real kvrelay cache server.

One set of engine runs, shared by the tests (an engine start is 20-60 s):
a baseline engine without a connector; a writer engine with the connector
(computes, writes its pages through, then prefills P/D requests and keeps
their blocks); then, in a fresh process while the writer lives, a reader
engine with the connector that takes prompts from the tier and decodes the
P/D requests by pulling the writer's blocks, in two phases with the cache
server killed between them. Before the reader starts the test writes two
kinds of pages into the tier itself: pages kvrelay's own model computed (an
import across engines) and, as a negative control, a real page of another
prompt under a prompt's keys.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.cache.launch import CacheServerProcess
from kvrelay.layout import ParallelConfig, rank_rectangle
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec, load_engine
from kvrelay.model.page_export import export_prefix
from kvrelay.model.requests import Request
from kvrelay.model.sampling import SamplingParams
from kvrelay.ports import free_port
from kvrelay.transfer import create_agent

TOKEN = "vllm-test-token"
BLOCK = 128  # vLLM's CPU block size: one kvrelay page
ENGINE_TIMEOUT_S = 600
ROOT = Path(__file__).resolve().parents[2]


def prompt(seed: int, pages: int) -> list[int]:
    """`pages` full pages and one more token (vLLM always computes the last one)."""
    rnd = random.Random(seed)
    return [rnd.randrange(512) for _ in range(pages * BLOCK + 1)]


P_REUSE, P_POISON, P_AFTER_KILL, P_VLLM_KV, P_KVRELAY_KV = (
    prompt(1, 8), prompt(2, 8), prompt(3, 4), prompt(4, 4), prompt(5, 8)
)  # fmt: skip
# Two prompts the reader gets at once: the second loads while the first runs.
P_TOGETHER = [prompt(6, 4), prompt(7, 4)]


def tokens(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(512) for _ in range(n)]


# P/D prompts: a partial last block, one token past a block, one short of a block;
# one whose prefill is unreachable; two of one length whose handoffs are swapped.
PD_PARTIAL, PD_PAST, PD_SHORT, PD_DEAD, PD_SWAPPED, PD_OTHER = (
    tokens(21, 5 * BLOCK + 37), tokens(22, 3 * BLOCK + 1), tokens(23, 3 * BLOCK - 1),
    tokens(24, 2 * BLOCK + 9), tokens(25, 4 * BLOCK + 5), tokens(26, 4 * BLOCK + 5),
)  # fmt: skip
PD_PROMPTS = [PD_PARTIAL, PD_PAST, PD_SHORT, PD_DEAD, PD_SWAPPED, PD_OTHER]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm") / "tiny-llama"
    subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "make-model", "--arch", "llama", "--layers", "2",
         "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "512",
         "--dtype", "bfloat16", "--max-positions", "4096", str(path)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def spec(model_dir):
    return kv_spec(model_dir, ModelConfig.from_dir(model_dir), "bfloat16", BLOCK)


def run_engine(tmp: Path, model_dir: Path, connector: dict | None, phases, between=None, env=None,
               engine_args: dict | None = None):  # fmt: skip
    """Runs engine_run.py; `between(phase)` runs before each phase after the first;
    `engine_args`: more of vLLM's `LLM` arguments."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "engine.json"
    config.write_text(json.dumps({"model": str(model_dir), "connector": connector,
                                  "phases": phases, "go_file": str(tmp / "phase"),
                                  "engine_args": engine_args}))  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               PYTHONPATH=str(ROOT), **(env or {}))  # fmt: skip
    log = tmp / "engine.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.engine_run", str(config)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    try:
        for phase in range(1, len(phases)):
            marker = tmp / f"phase.{phase}"
            while not marker.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"engine stopped before phase {phase}:\n{log.read_text()[-4000:]}")
                time.sleep(0.1)
            if between is not None:
                between(phase)
            Path(f"{marker}.go").touch()
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, log.read_text()[-4000:]
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    expected = sum(len(p["batch"]) if isinstance(p, dict) and "batch" in p else 1
                   for phase in phases for p in phase)  # fmt: skip
    assert len(results) == expected, out
    return results


def connector(server: str, spec) -> dict:
    return {"servers": [server], "token": TOKEN, "model_id": spec.model_id,
            "weights_fingerprint": spec.weights_fingerprint, "timeout_s": 5.0}  # fmt: skip


async def tier_pages(server: str, spec, tokens, write_rows: torch.Tensor | None = None):
    """Reads (or, with `write_rows`, writes) the full pages of `tokens` in the tier."""
    keys = spec.page_keys(tokens[: len(tokens) // spec.page_size * spec.page_size])
    agent = await create_agent("tcp", token=TOKEN)
    try:
        client = CacheClient(
            agent, spec, rank_rectangle(spec, ParallelConfig()),
            CacheClientConfig(servers=(server,), token=TOKEN, timeout_s=10),
        )  # fmt: skip
        arena = agent.allocate_arena(len(keys) * spec.page_bytes)
        rows = arena.tensor.view(len(keys), spec.page_bytes)
        offsets = [i * spec.page_bytes for i in range(len(keys))]
        if write_rows is not None:
            rows.copy_(write_rows)
            assert await client.write(keys, arena, offsets) == len(keys)
            result = None
        else:
            found = await client.lookup(keys, arena, offsets)
            result = rows[:found].clone()
        await client.close()
        return result
    finally:
        await agent.close()


def plant_pages(server: str, spec, read, reuse, poison, ours, ours_rows) -> torch.Tensor:
    """While a writer engine holds its P/D blocks: returns the full pages of
    `read` in the tier, puts `reuse`'s real pages under `poison`'s keys (the
    negative control) and `ours_rows` (kvrelay's runner's) under `ours`'s."""
    found = asyncio.run(tier_pages(server, spec, read))
    wrong = asyncio.run(tier_pages(server, spec, reuse))
    asyncio.run(tier_pages(server, spec, poison, write_rows=wrong))
    asyncio.run(tier_pages(server, spec, ours, write_rows=ours_rows))
    return found


def held_handoffs(writer_dir: Path) -> list[dict]:
    """The writer engine's phase-1 replies: the P/D prefills it holds."""
    lines = (writer_dir / "phase.results").read_text().splitlines()
    return [json.loads(line) for line in lines if json.loads(line)["phase"] == 1]


def kvrelay_pages(model_dir: Path, tokens) -> torch.Tensor:
    """kvrelay's own runner: the full pages of `tokens`, computed cold, as unified rows."""
    engine = load_engine(model_dir, dtype="bfloat16", page_size=BLOCK, num_pages=64)
    engine.generate([Request(list(tokens), SamplingParams(max_new_tokens=1))])
    full = len(tokens) // BLOCK
    rows = torch.zeros(full + 1, engine.spec.page_bytes, dtype=torch.uint8)
    export_prefix(engine, tokens, rows)
    return rows[:full]


def decode_requests(prefills: list[dict]) -> list[dict]:
    """The decode half of each P/D prompt, carrying its prefill's params; PD_DEAD's
    name a closed port, PD_SWAPPED's are PD_OTHER's (another prompt's blocks)."""
    params = {tuple(p): r["kv_transfer_params"] for p, r in zip(PD_PROMPTS, prefills, strict=True)}
    dead = json.loads(json.dumps(params[tuple(PD_DEAD)]))
    dead["kvrelay"]["agents"] = [f"127.0.0.1:{free_port()}"]
    params[tuple(PD_DEAD)] = dead
    params[tuple(PD_SWAPPED)] = params[tuple(PD_OTHER)]
    for p in params.values():
        # vLLM reports a decode's cached tokens as this prefill-side figure
        # when present; without it, as the tokens the decode did not compute.
        p.pop("remote_prefill_cached_tokens", None)
    return [{"tokens": p, "kv_transfer_params": params[tuple(p)]} for p in PD_PROMPTS[:-1]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir, spec):
    tmp = tmp_path_factory.mktemp("runs")
    everything = [P_REUSE, P_POISON, P_AFTER_KILL, P_VLLM_KV, P_KVRELAY_KV, *P_TOGETHER,
                  *PD_PROMPTS]  # fmt: skip
    baseline = run_engine(tmp / "baseline", model_dir, None, [everything])
    server = CacheServerProcess(token=TOKEN, page_bytes=spec.page_bytes, pages=128)
    found = {}
    try:
        extra = connector(server.address, spec)
        prefill_extra = dict(extra, handoff_port=free_port(), handoff_hold_s=900.0)
        prefills = [{"tokens": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
                    for p in PD_PROMPTS]  # fmt: skip

        def kill_cache_server(phase: int) -> None:
            server.kill()

        def read_while_the_writer_holds(phase: int) -> None:
            if phase != 2:
                return
            found["vllm_kv"] = plant_pages(
                server.address,
                spec,
                P_VLLM_KV,
                P_REUSE,
                P_POISON,
                P_KVRELAY_KV,
                kvrelay_pages(model_dir, P_KVRELAY_KV),
            )
            found["ours"] = kvrelay_pages(model_dir, P_VLLM_KV)
            held = held_handoffs(tmp / "writer")
            found["reader"] = run_engine(
                tmp / "reader", model_dir, extra,
                [[P_REUSE, P_POISON, P_KVRELAY_KV, {"batch": P_TOGETHER},
                  *decode_requests(held)], [P_AFTER_KILL]],
                between=kill_cache_server, env={"KVRELAY_VLLM_TRANSFER_LOG": str(transfers)},
            )  # fmt: skip

        transfers = tmp / "reader-transfers.jsonl"
        writer = run_engine(tmp / "writer", model_dir, prefill_extra,
                            [[P_REUSE, P_VLLM_KV, *P_TOGETHER], prefills, []],
                            between=read_while_the_writer_holds)  # fmt: skip
    finally:
        server.stop()
    base = {tuple(p): r["tokens"] for p, r in zip(everything, baseline, strict=True)}
    records = [json.loads(line) for line in transfers.read_text().splitlines()]
    return {"base": base, "writer": writer, "transfers": records, **found}


def test_a_fresh_engine_takes_the_prompt_from_the_tier(runs):
    writer, reader = runs["writer"], runs["reader"]
    assert writer[0]["tokens"] == runs["base"][tuple(P_REUSE)]
    assert writer[0]["cached"] == 0
    assert reader[0]["cached"] >= 0.9 * len(P_REUSE)
    assert reader[0]["tokens"] == runs["base"][tuple(P_REUSE)]


def test_wrong_pages_in_the_tier_change_the_output(runs):
    poisoned = runs["reader"][1]
    assert poisoned["cached"] >= 0.9 * len(P_POISON)  # the pages were used ...
    assert poisoned["tokens"] != runs["base"][tuple(P_POISON)]  # ... and they matter


def test_vllm_kv_equals_kvrelays_position_by_position(runs):
    theirs = runs["vllm_kv"].view(torch.bfloat16).float()
    ours = runs["ours"].view(torch.bfloat16).float()
    assert theirs.shape == ours.shape and theirs.shape[0] == len(P_VLLM_KV) // BLOCK
    # Both engines round to bfloat16 at every op: a few ulps of the values.
    assert torch.allclose(theirs, ours, rtol=0.05, atol=0.05), (theirs - ours).abs().max()
    assert (theirs - ours).abs().mean() < 0.01 * ours.abs().mean()


def test_vllm_imports_pages_kvrelay_computed(runs):
    imported = runs["reader"][2]
    assert imported["cached"] >= 0.9 * len(P_KVRELAY_KV)


def test_a_load_beside_a_running_request_waits_off_the_step(runs):
    together = runs["reader"][3:5]
    for p, r in zip(P_TOGETHER, together, strict=True):
        assert r["cached"] >= 0.9 * len(p)
        assert r["tokens"] == runs["base"][tuple(p)]
    # the second was parked while its pages loaded, reported by get_finished
    assert [r for r in runs["transfers"] if r.get("async")]


def test_a_dead_cache_server_means_recompute_not_failure(runs):
    after = runs["reader"][-1]
    assert after["phase"] == 1
    assert after["cached"] == 0
    assert after["tokens"] == runs["base"][tuple(P_AFTER_KILL)]


def pd_results(runs) -> dict:
    decodes = runs["reader"][5:-1]
    return {tuple(p): r for p, r in zip(PD_PROMPTS[:-1], decodes, strict=True)}


def test_a_prefill_for_a_remote_decode_returns_handoff_params(runs):
    prefills = [r for r in runs["writer"] if r["phase"] == 1]
    for p, r in zip(PD_PROMPTS, prefills, strict=True):
        assert r["tokens"] == runs["base"][tuple(p)][:1]
        params = r["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["kvrelay"]["num_tokens"] == len(p)
        assert len(params["kvrelay"]["block_ids"]) == -(-len(p) // BLOCK)


def test_a_pd_pair_returns_the_single_engines_tokens(runs):
    decoded = pd_results(runs)
    for p in (PD_PARTIAL, PD_PAST, PD_SHORT):
        # Every prompt token but the last came from the prefill's blocks,
        # the partial last block included (the tier holds full pages only).
        assert decoded[tuple(p)]["cached"] == len(p) - 1
        assert decoded[tuple(p)]["tokens"] == runs["base"][tuple(p)]


def test_an_unreachable_prefill_means_recompute_not_failure(runs):
    dead = pd_results(runs)[tuple(PD_DEAD)]
    assert dead["tokens"] == runs["base"][tuple(PD_DEAD)]


def test_pulled_blocks_are_what_the_decode_computes_with(runs):
    swapped = pd_results(runs)[tuple(PD_SWAPPED)]
    assert swapped["cached"] == len(PD_SWAPPED) - 1  # another prompt's blocks were pulled ...
    assert swapped["tokens"] != runs["base"][tuple(PD_SWAPPED)]  # ... and they matter
