"""A real SGLang server (CPU engine, torch_native attention) running a
DeepSeek-V3-shaped model (MLA, MoE, yarn RoPE) with kvrelay as its L3.

After `/flush_cache` the prompt's full pages come from kvrelay and the
output equals the cold run; kvrelay's runner (`--key-scheme sglang`, the
same model directory) finds every page SGLang wrote, holding its own latent
rows position by position (to float32 rounding: the two engines' kernels
differ), and continues from them to its own cold run's tokens.
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


def test_deepseek_v3_on_sglang_takes_its_prompt_from_kvrelay(model, tmp_path):
    model_dir, spec = model
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, 250, (FULL * PAGE + 7,), generator=g).tolist()
    listen = f"127.0.0.1:{free_port()}"
    cache = CacheServerProcess(token=TOKEN, page_bytes=spec.page_bytes, pages=256, listen=listen)
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
    finally:
        server.stop()
    try:
        found, pages = asyncio.run(read_with_worker_keys([listen], spec, prompt))
        assert found == FULL
        runner = load_engine(model_dir, dtype=DTYPE, page_size=PAGE, num_pages=32,
                             key_scheme="sglang")  # fmt: skip
        want = runner.generate([Request(prompt, SamplingParams(NEW))])[0].tokens
        own = torch.zeros(FULL, spec.page_bytes, dtype=torch.uint8)
        assert export_prefix(runner, prompt[: FULL * PAGE], own) == FULL
        theirs, mine = pages.view(torch.float32), own.view(torch.float32)
        assert torch.allclose(theirs, mine, rtol=1e-4, atol=1e-4), (theirs - mine).abs().max()
        warm_runner = load_engine(model_dir, dtype=DTYPE, page_size=PAGE, num_pages=32,
                                  key_scheme="sglang")  # fmt: skip
        assert import_prefix(warm_runner, prompt[: FULL * PAGE], pages) == FULL
        out = warm_runner.generate([Request(prompt, SamplingParams(NEW))])[0]
        assert out.cached_tokens == FULL * PAGE and out.tokens == want
        assert cold.output_ids == want  # the two engines agree on this prompt
    finally:
        cache.stop()
