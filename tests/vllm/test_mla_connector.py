"""KvrelayConnector moving MLA caches: a DeepSeek-V3-shaped model on vLLM's
CPU MLA backend, real engines and a real kvrelay cache server.

The model has DeepSeek-V3's latent (kv_lora_rank 512 + qk_rope_head_dim 64,
v_head_dim 512: the only shape the CPU MLA kernels take, 16-token blocks)
and is small elsewhere. vLLM's CPU platform runs MLA models with prefix
caching and chunked prefill off, so every token an engine does not compute
here came through the connector.

Engine runs, shared by the tests: a baseline engine without a connector; a
writer engine with the connector (computes and writes its pages through,
then prefills P/D requests and keeps their blocks); while the writer lives,
the test reads the writer's pages from the tier, computes the same prompt's
pages with kvrelay's own runner, writes runner pages of one prompt and, as a
negative control, a real page of another prompt under a prompt's keys; then
a reader engine takes prompts from the tier and decodes the P/D requests by
pulling the writer's blocks.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvrelay.cache.launch import CacheServerProcess
from kvrelay.model.loader import load_engine, model_kv_spec
from kvrelay.model.page_export import export_prefix
from kvrelay.model.requests import Request
from kvrelay.model.sampling import SamplingParams
from kvrelay.ports import free_port
from tests.vllm.test_connector import TOKEN, connector, held_handoffs, plant_pages, run_engine

BLOCK = 16  # the CPU MLA backend's only block size: one kvrelay page
LORA, ROPE = 512, 64
# vLLM 0.32's CPU `rotary_embedding` op rotates DeepSeek's k_pe (GPT-J
# style, a strided view of kv_a_proj's output) by the wrong positions, and
# by none past the first few tokens of a batch: its outputs then depart
# from transformers' and depend on how a prompt is batched. The op's
# torch-native twin is right; every engine here runs with it.
ENGINE_ARGS = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}, "dtype": "float32"}


def tokens(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(512) for _ in range(n)]


# Full pages and one more token (vLLM always computes the last one).
P_REUSE, P_VLLM_KV, P_KVRELAY_KV = (
    tokens(31, 16 * BLOCK + 1), tokens(33, 8 * BLOCK + 1), tokens(34, 16 * BLOCK + 1),
)  # fmt: skip
# Another prompt ending in P_REUSE's last token: under P_REUSE's pages its
# tokens must be P_REUSE's, whatever its own prompt says.
P_POISON = tokens(32, 16 * BLOCK) + P_REUSE[-1:]
# P/D: a partial last block; two of one length whose handoffs are swapped
# (the decode pulls the other prompt's blocks). P_REUSE goes through the
# handoff too: its decode is the reference of its tier load (the same
# last-token computation over the writer's own blocks).
PD_PARTIAL, PD_SWAPPED, PD_OTHER = (
    tokens(41, 5 * BLOCK + 7), tokens(43, 4 * BLOCK + 5), tokens(44, 4 * BLOCK + 5),
)  # fmt: skip
PD_PROMPTS = [P_REUSE, PD_PARTIAL, PD_SWAPPED, PD_OTHER]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm-mla") / "tiny-deepseek-v3"
    # std 0.15: outputs that depend on the whole context, not the last token
    subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "make-model", "--arch", "deepseek_v3",
         "--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--vocab", "512",
         "--kv-lora-rank", str(LORA), "--qk-rope-dim", str(ROPE), "--qk-nope-dim", "32",
         "--v-head-dim", "512", "--q-lora-rank", "0", "--experts", "4", "--groups", "2",
         "--moe-intermediate", "32", "--std", "0.15", "--dtype", "float32",
         "--max-positions", "4096", str(path)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def spec(model_dir):
    return model_kv_spec(model_dir, "float32", BLOCK)


def runner_pages(model_dir: Path, prompt) -> torch.Tensor:
    """kvrelay's own runner: the full pages of `prompt`, computed cold, as unified rows."""
    engine = load_engine(model_dir, dtype="float32", page_size=BLOCK, num_pages=64)
    engine.generate([Request(list(prompt), SamplingParams(max_new_tokens=1))])
    full = len(prompt) // BLOCK
    rows = torch.zeros(full + 1, engine.spec.page_bytes, dtype=torch.uint8)
    export_prefix(engine, prompt, rows)
    return rows[:full]


def decode_requests(prefills: list[dict]) -> list[dict]:
    """The decode half of each P/D prompt but PD_OTHER, with its prefill's
    params; PD_SWAPPED's are PD_OTHER's."""
    params = {tuple(p): r["kv_transfer_params"] for p, r in zip(PD_PROMPTS, prefills, strict=True)}
    params[tuple(PD_SWAPPED)] = params[tuple(PD_OTHER)]
    for p in params.values():
        p.pop("remote_prefill_cached_tokens", None)  # count the decode's own cached tokens
    return [{"tokens": p, "kv_transfer_params": params[tuple(p)]} for p in PD_PROMPTS[:-1]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir, spec):
    tmp = tmp_path_factory.mktemp("mla-runs")
    everything = [P_REUSE, P_POISON, P_VLLM_KV, P_KVRELAY_KV, *PD_PROMPTS[1:]]
    baseline = run_engine(tmp / "baseline", model_dir, None, [everything], engine_args=ENGINE_ARGS)
    server = CacheServerProcess(token=TOKEN, page_bytes=spec.page_bytes, pages=256)
    found = {}
    try:
        extra = connector(server.address, spec)
        prefill_extra = dict(extra, handoff_port=free_port(), handoff_hold_s=900.0)
        prefills = [{"tokens": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
                    for p in PD_PROMPTS]  # fmt: skip

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
                runner_pages(model_dir, P_KVRELAY_KV),
            )
            found["ours"] = runner_pages(model_dir, P_VLLM_KV)
            held = held_handoffs(tmp / "writer")
            found["reader"] = run_engine(
                tmp / "reader", model_dir, extra,
                [[P_REUSE, P_POISON, P_KVRELAY_KV, PD_SWAPPED, *decode_requests(held)]],
                engine_args=ENGINE_ARGS,
            )  # fmt: skip

        writer = run_engine(tmp / "writer", model_dir, prefill_extra,
                            [[P_REUSE, P_VLLM_KV], prefills, []],
                            between=read_while_the_writer_holds,
                            engine_args=ENGINE_ARGS)  # fmt: skip
    finally:
        server.stop()
    base = {tuple(p): r["tokens"] for p, r in zip(everything, baseline, strict=True)}
    return {"base": base, "writer": writer, **found}


def test_prefix_caching_is_off_for_mla_on_cpu(model_dir):
    """The config the engines run with: every token a reader below does not
    compute came through the connector, none from vLLM's own prefix cache."""
    from vllm.engine.arg_utils import EngineArgs

    from tests.vllm.engine_run import connector_config

    config = EngineArgs(model=str(model_dir), dtype="float32", skip_tokenizer_init=True,
                        enforce_eager=True, kv_transfer_config=connector_config({}),
                        ).create_engine_config()  # fmt: skip
    assert config.model_config.use_mla
    assert not config.cache_config.enable_prefix_caching
    assert not config.scheduler_config.enable_chunked_prefill


def reader(runs) -> tuple[dict, dict]:
    """The reader's tier loads and its P/D decodes, by prompt."""
    loaded = [P_REUSE, P_POISON, P_KVRELAY_KV, PD_SWAPPED]
    loads = dict(zip(map(tuple, loaded), runs["reader"][:4], strict=True))
    decodes = dict(zip(map(tuple, PD_PROMPTS[:-1]), runs["reader"][4:], strict=True))
    return loads, decodes


def test_a_writer_computes_as_a_cold_engine(runs):
    writer = runs["writer"]
    assert writer[0]["cached"] == 0
    assert writer[0]["tokens"] == runs["base"][tuple(P_REUSE)]


def test_a_fresh_mla_engine_takes_the_prompt_from_the_tier(runs):
    loads, decodes = reader(runs)
    assert loads[tuple(P_REUSE)]["cached"] == len(P_REUSE) - 1  # every full page
    assert loads[tuple(P_REUSE)]["tokens"] == runs["base"][tuple(P_REUSE)]
    assert decodes[tuple(P_REUSE)]["tokens"] == runs["base"][tuple(P_REUSE)]


def test_wrong_latent_pages_change_the_output(runs):
    loads, _ = reader(runs)
    poisoned = loads[tuple(P_POISON)]
    assert poisoned["cached"] == len(P_POISON) - 1  # the pages were used ...
    # ... and they matter: the tokens follow the pages, not the prompt
    assert runs["base"][tuple(P_POISON)] != runs["base"][tuple(P_REUSE)]
    assert poisoned["tokens"] == loads[tuple(P_REUSE)]["tokens"]


def latent(rows: torch.Tensor) -> torch.Tensor:
    """Unified MLA rows as [pages, layers, BLOCK, LORA + ROPE] floats."""
    return rows.view(torch.float32).view(rows.shape[0], 2, BLOCK, LORA + ROPE)


def test_vllm_latent_pages_equal_the_runners_position_by_position(runs):
    theirs, ours = latent(runs["vllm_kv"]), latent(runs["ours"])
    assert theirs.shape == ours.shape and theirs.shape[0] == len(P_VLLM_KV) // BLOCK
    # Position by position, RoPE part included: float32 rows of two engines'
    # kernels (layer 1's follow each engine's attention).
    assert torch.allclose(theirs, ours, rtol=1e-4, atol=1e-4), (theirs - ours).abs().max()
    # ... and not by accident: the neighbouring page is far from them
    assert not torch.allclose(theirs[1:], ours[:-1], rtol=1e-2, atol=1e-2)


def test_vllm_takes_the_prompt_from_pages_kvrelays_runner_computed(runs):
    loads, _ = reader(runs)
    assert loads[tuple(P_KVRELAY_KV)]["cached"] == len(P_KVRELAY_KV) - 1
    assert loads[tuple(P_KVRELAY_KV)]["tokens"] == runs["base"][tuple(P_KVRELAY_KV)]


def test_an_mla_pd_decode_takes_every_prompt_token_but_the_last(runs):
    _, decodes = reader(runs)
    for p in PD_PROMPTS[:-1]:  # PD_PARTIAL's partial last block included
        assert decodes[tuple(p)]["cached"] == len(p) - 1
    for p in (P_REUSE, PD_PARTIAL):
        assert decodes[tuple(p)]["tokens"] == runs["base"][tuple(p)]


def test_pulled_latent_blocks_are_what_the_decode_computes_with(runs):
    loads, decodes = reader(runs)
    assert loads[tuple(PD_SWAPPED)]["cached"] == len(PD_SWAPPED) // BLOCK * BLOCK
    # PD_SWAPPED decoded over PD_OTHER's blocks is not PD_SWAPPED over its own pages
    assert decodes[tuple(PD_SWAPPED)]["tokens"] != loads[tuple(PD_SWAPPED)]["tokens"]
