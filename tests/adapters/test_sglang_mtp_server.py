"""A real SGLang server (CPU engine, torch_native attention) running a
DeepSeek-V3-shaped model with MTP speculative decoding (EAGLE, a chain of 3
drafts) and kvrelay as its L3.

SGLang packs the MTP layer into HiCache's KV host pool after the target's
layers; kvrelay keeps its latent in draft pages of their own. After
`/flush_cache` the prompt's pages (target and draft) come from kvrelay, the
output equals the cold run and so does the acceptance; with the draft pages
replaced by noise the hit is as long and the output the same, but the draft
drafts from the noise and the acceptance changes: the draft's KV on a hit is
the one kvrelay's draft pages hold.

The model: SGLang reads a one-layer model's MTP layer from
`model.layers.0` (the layout of a separate draft checkpoint,
`deepseek_weight_loader._initialize_nextn_conf`), so the target has two
layers. Its MTP layer is layer 0's copy (`mtp_init="copy"`) and layer 1's
output projections are scaled down, so that the draft, which re-runs layer 0
one token ahead, agrees with the target often.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.adapters.sglang.cpu.server import SGLangServer, free_port, kvrelay_extra
from kvrelay.cache.launch import CacheServerProcess
from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.make_mla_model import MlaModelSpec, write_mla_model
from kvrelay.model.mla_loader import mla_config_from_dir, mla_kv_spec
from tests.adapters import sglang_env as env
from tests.adapters.test_sglang_mla_server import SGLANG_FIELDS, YARN

TOKEN = env.TOKEN
PAGE, FULL, NEW, STEPS = 16, 20, 24, 3
DTYPE = "float32"
LATENT, ROPE = 32, 16
TARGET_LAYERS = 2  # the MTP layer's rows follow in SGLang's host pool
LAYER1_OUTPUT_SCALE = 0.3  # the draft then agrees on about half its drafts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    spec = MlaModelSpec(arch="deepseek_v3", layers=TARGET_LAYERS, first_dense=0, q_lora_rank=None,
                        kv_lora_rank=LATENT, qk_rope=ROPE, std=0.2, seed=13,
                        rope_scaling=YARN, mtp=1, mtp_init="copy")  # fmt: skip
    model_dir = write_mla_model(tmp_path_factory.mktemp("dsv3-mtp") / "deepseek_v3-mtp", spec)
    config = json.loads((model_dir / "config.json").read_text())
    # The MLA test's fields but its num_nextn_predict_layers (0, no MTP).
    fields = {k: v for k, v in SGLANG_FIELDS.items() if k != "num_nextn_predict_layers"}
    assert config["num_nextn_predict_layers"] == 1
    (model_dir / "config.json").write_text(json.dumps(config | fields))
    weights = model_dir / "model.safetensors"
    tensors = load_file(str(weights))
    outputs = ("o_proj.weight", "down_proj.weight")
    for name, t in tensors.items():
        if name.startswith("model.layers.1.") and name.endswith(outputs):
            tensors[name] = t * LAYER1_OUTPUT_SCALE
    save_file(tensors, str(weights), metadata={"format": "pt"})
    kv = mla_kv_spec(model_dir, mla_config_from_dir(model_dir), DTYPE, PAGE, key_scheme="sglang")
    return model_dir, kv


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (FULL * PAGE + 7,), generator=g).tolist()


def _keys(prompt) -> list[str]:
    """The keys of the prompt's full pages (by token pairs: one token more)."""
    return env.sglang_keys(prompt[: FULL * PAGE + 1], PAGE, eagle=True)


class Pages:
    """An SGLang rank's backend in this process, with the server's identity
    and host pool geometry (the MTP layer packed after the target's two), so
    it names the pages the server writes."""

    def __init__(self, extra: dict) -> None:
        self.pool = env.mla_pool("layer_first", layers=TARGET_LAYERS, start_layer=0, page_size=PAGE,
                                 width=LATENT + ROPE, dtype=torch.float32, rope=ROPE, packed=1,
                                 device_tokens=FULL * PAGE)  # fmt: skip
        config = env.storage_config(mla=True, layout="layer_first", extra=extra)
        self.backend = env.create_backend(config, self.pool)

    def found(self, prompt) -> int:
        """Pages of `prompt` whose target and draft pages are both in the tier."""
        return self.backend.batch_exists(_keys(prompt))

    def replace_drafts_with_noise(self, prompt) -> None:
        """Read the prompt's pages, drop this model's pages from the tier and
        write them back with noise in the MTP layer's rows: the target pages
        as they were, the draft pages anew."""
        keys = _keys(prompt)
        idx = self.pool.alloc(len(keys) * PAGE)
        assert self.found(prompt) == FULL
        assert self.backend.batch_get_v1(keys, idx) == [True] * len(keys)
        draft = self.pool.kv_buffer[TARGET_LAYERS:, idx]
        assert draft.abs().sum() > 0  # the server's draft latent came with the pages
        self.backend.clear()
        assert self.found(prompt) == 0
        self.pool.kv_buffer[TARGET_LAYERS:, idx] = torch.randn_like(draft)
        assert self.backend.batch_set_v1(keys, idx) == [True] * len(keys)

    def close(self) -> None:
        self.backend.close()


def _wait_found(pages: Pages, prompt, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (found := pages.found(prompt)) < FULL:
        assert time.monotonic() < deadline, f"{found} of {FULL} pages reached the tier"
        time.sleep(0.5)


def test_deepseek_v3_with_mtp_on_sglang_takes_target_and_draft_pages_from_kvrelay(model, tmp_path):
    model_dir, spec = model
    prompt = _prompt(5)
    runner = load_engine(model_dir, dtype=DTYPE, page_size=PAGE, num_pages=64)
    want = runner.generate([Request(prompt, SamplingParams(NEW))])[0].tokens
    del runner
    listen = f"127.0.0.1:{free_port()}"
    cache = CacheServerProcess(token=TOKEN, page_bytes=spec.page_bytes, pages=256, listen=listen)
    identity = {"model_id": spec.model_id, "weights_fingerprint": spec.weights_fingerprint}
    extra = kvrelay_extra([listen], TOKEN, timeout_s=5.0, **identity)
    server = SGLangServer(model_dir, tmp_path / "sglang.log", extra=extra, page_size=PAGE,
                          dtype=DTYPE, threads=1, start_timeout_s=420,
                          speculative_steps=STEPS)  # fmt: skip
    pages = None
    try:
        server.start()
        cold = server.generate(prompt, NEW)
        assert cold.output_ids == want  # greedy speculation keeps the target's tokens
        assert cold.spec["spec_verify_ct"] < NEW and cold.spec["spec_num_correct_drafts"] > 0
        pages = Pages(extra)
        logged = re.search(r"draft namespace ([0-9a-f]{16})", server.log_tail(400))
        assert logged and logged.group(1) == pages.backend.draft_namespace.hex()[:16]
        _wait_found(pages, prompt)

        server.flush()
        warm = server.generate(prompt, NEW)
        assert warm.storage_tokens == FULL * PAGE, warm
        assert warm.output_ids == cold.output_ids
        assert warm.spec == cold.spec, (cold.spec, warm.spec)

        pages.replace_drafts_with_noise(prompt)
        assert pages.found(prompt) == FULL
        server.flush()
        noisy = server.generate(prompt, NEW)
        assert noisy.storage_tokens == FULL * PAGE, noisy
        assert noisy.output_ids == cold.output_ids
        assert noisy.spec != cold.spec, noisy.spec
    finally:
        server.stop()
        if pages is not None:
            pages.close()
        cache.stop()
