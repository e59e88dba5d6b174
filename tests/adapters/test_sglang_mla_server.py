"""A real SGLang server (CPU engine, torch_native attention) running a
DeepSeek-V3-shaped model (MLA, MoE, yarn RoPE) with kvrelay as its L3.

After `/flush_cache` the prompt's full pages come from kvrelay and the
output equals the cold run; a prompt whose pages kvrelay's runner wrote is
taken from them and continued as the runner continues it; kvrelay's runner
(`--key-scheme sglang`, the same model directory) finds every page SGLang
wrote, holding its own latent rows position by position (to float32
rounding: the two engines' kernels differ), and continues from them to its
own cold run's tokens.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from kvrelay.adapters.sglang.cpu.server import SGLangServer, free_port, kvrelay_extra
from kvrelay.cache.launch import CacheServerProcess
from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.make_mla_model import MlaModelSpec, write_mla_model
from kvrelay.model.mla_loader import mla_config_from_dir, mla_kv_spec
from kvrelay.model.page_export import export_prefix, import_prefix
from tests.adapters import sglang_env as env
from tests.adapters.test_sglang_mla_runner import read_with_worker_keys

TOKEN = env.TOKEN
PAGE, FULL, NEW = 16, 20, 8  # SGLang prefetches prompts over 256 tokens
DTYPE = "float32"
YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
# Fields SGLang's DeepSeek model reads that transformers' config leaves out.
SGLANG_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                 "ep_size": 1, "num_nextn_predict_layers": 0}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    spec = MlaModelSpec(arch="deepseek_v3", layers=3, q_lora_rank=None, std=0.2, seed=13,
                        rope_scaling=YARN)  # fmt: skip
    model_dir = write_mla_model(tmp_path_factory.mktemp("dsv3") / "deepseek_v3-tiny", spec)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | SGLANG_FIELDS))
    kv = mla_kv_spec(model_dir, mla_config_from_dir(model_dir), DTYPE, PAGE, key_scheme="sglang")
    return model_dir, kv


async def write_with_worker_keys(servers, spec, prompt, pages: torch.Tensor) -> int:
    """Put the runner's unified pages of `prompt` in the tier, keyed from token ids."""
    from kvrelay.cache.client import CacheClient, CacheClientConfig
    from kvrelay.layout import Rectangle
    from kvrelay.transfer import create_agent

    keys = spec.page_keys(prompt)[: len(pages)]
    agent = await create_agent("tcp", token=TOKEN)
    arena = agent.allocate_arena(pages.numel())
    arena.tensor[: pages.numel()].copy_(pages.reshape(-1))
    client = CacheClient(agent, spec, Rectangle(0, 1, 0, spec.num_layers),
                         CacheClientConfig(servers=tuple(servers), token=TOKEN))  # fmt: skip
    try:
        return await client.write(keys, arena, [i * spec.page_bytes for i in range(len(keys))])
    finally:
        await client.close()
        await agent.close()


def _runner(model_dir):
    return load_engine(model_dir, dtype=DTYPE, page_size=PAGE, num_pages=64, key_scheme="sglang")


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (FULL * PAGE + 7,), generator=g).tolist()


def test_deepseek_v3_on_sglang_takes_its_prompt_from_kvrelay(model, tmp_path):
    model_dir, spec = model
    prompt, other = _prompt(5), _prompt(6)
    listen = f"127.0.0.1:{free_port()}"
    cache = CacheServerProcess(token=TOKEN, page_bytes=spec.page_bytes, pages=256, listen=listen)
    # kvrelay's runner computes `other` and puts its pages in the tier.
    runner = _runner(model_dir)
    other_want = runner.generate([Request(other, SamplingParams(NEW))])[0].tokens
    other_pages = torch.zeros(FULL, spec.page_bytes, dtype=torch.uint8)
    assert export_prefix(runner, other[: FULL * PAGE], other_pages) == FULL
    del runner
    assert asyncio.run(write_with_worker_keys([listen], spec, other, other_pages)) == FULL
    identity = {"model_id": spec.model_id, "weights_fingerprint": spec.weights_fingerprint}
    extra = kvrelay_extra([listen], TOKEN, timeout_s=5.0, **identity)
    server = SGLangServer(model_dir, tmp_path / "sglang.log", extra=extra, page_size=PAGE,
                          dtype=DTYPE, threads=1, start_timeout_s=420)  # fmt: skip
    try:
        server.start()
        cold = server.generate(prompt, NEW)
        deadline = time.monotonic() + 60
        while (found := asyncio.run(read_with_worker_keys([listen], spec, prompt))[0]) < FULL:
            assert time.monotonic() < deadline, f"{found} of {FULL} pages reached the tier"
            time.sleep(0.5)
        server.flush()
        warm = server.generate(prompt, NEW)
        assert warm.storage_tokens == FULL * PAGE, warm
        assert warm.output_ids == cold.output_ids
        # The runner's pages: SGLang takes them and continues as the runner does.
        taken = server.generate(other, NEW)
        assert taken.storage_tokens == FULL * PAGE, taken
        assert taken.output_ids == other_want
    finally:
        server.stop()
    try:
        found, pages = asyncio.run(read_with_worker_keys([listen], spec, prompt))
        assert found == FULL
        runner = _runner(model_dir)
        want = runner.generate([Request(prompt, SamplingParams(NEW))])[0].tokens
        own = torch.zeros(FULL, spec.page_bytes, dtype=torch.uint8)
        assert export_prefix(runner, prompt[: FULL * PAGE], own) == FULL
        theirs, mine = pages.view(torch.float32), own.view(torch.float32)
        assert torch.allclose(theirs, mine, rtol=1e-4, atol=1e-4), (theirs - mine).abs().max()
        warm_runner = _runner(model_dir)
        assert import_prefix(warm_runner, prompt[: FULL * PAGE], pages) == FULL
        out = warm_runner.generate([Request(prompt, SamplingParams(NEW))])[0]
        assert out.cached_tokens == FULL * PAGE and out.tokens == want
        assert cold.output_ids == want  # the two engines agree on this prompt
    finally:
        cache.stop()
