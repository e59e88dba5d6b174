"""The two-GPU integration test: a real cluster (control, a cache server,
prefill and decode pools as processes started through the CLI) with prefill
on cuda:0 and decode on cuda:1, or both on cuda:0 in separate processes on a
one-GPU machine. Pages move GPU -> GPU (prefill's GPU staging to decode's),
GPU -> host (write-through to the tier) and host -> GPU (tier hits) over UCX.
Tokens are compared with `kvrelay generate` in one process on cuda:0, in
float64 so greedy choices cannot flip on rounding. Skipped without CUDA."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from kvrelay.cli import main as kvrelay_main
from kvrelay.demo.cluster import ClusterConfig, LocalCluster, PoolConfig
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec
from tests.integration.test_cluster import (
    DTYPE,
    PAGE,
    cached,
    complete,
    rng_tokens,
    stats,
    tokens_of,
)

pytestmark = pytest.mark.gpu


def decode_gpu() -> str:
    return "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def generate_on_gpu(model_dir, prompt, max_tokens) -> list[int]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        kvrelay_main([
            "generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", str(max_tokens), "--dtype", DTYPE, "--page-size", str(PAGE),
            "--device", "cuda:0", "--json",
        ])  # fmt: skip
    return json.loads(out.getvalue())["tokens"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvrelay.model import RandomModelSpec, write_model

    spec = RandomModelSpec(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, std=0.2, seed=6)
    return write_model(tmp_path_factory.mktemp("gpu-cluster") / "qwen2", spec)


def test_prefill_on_one_gpu_decode_on_another(model_dir, tmp_path):
    page_bytes = kv_spec(model_dir, ModelConfig.from_dir(model_dir), DTYPE, PAGE).page_bytes
    config = ClusterConfig(
        model_dir=model_dir, log_dir=tmp_path / "logs", page_bytes=page_bytes, page_size=PAGE,
        dtype=DTYPE, prefill_pages=256, decode_pages=256, cache_gb=0.05, backend="ucx",
        prefill=PoolConfig(device="cuda:0", staging="device"),
        decode=PoolConfig(device=decode_gpu(), staging="device"),
    )  # fmt: skip
    cluster = LocalCluster(config).start()
    try:
        url = cluster.control_url
        p1 = rng_tokens(11, 150)
        a1 = complete(url, p1, 12)
        assert tokens_of(a1) == generate_on_gpu(model_dir, p1, 12)
        assert cached(a1) == (0, 0)

        # Second turn: the conversation so far comes back from prefill's pool
        # and the tier (decode wrote the answer's pages back from its GPU).
        p2 = p1 + tokens_of(a1) + rng_tokens(12, 40)
        a2 = complete(url, p2, 12)
        assert tokens_of(a2) == generate_on_gpu(model_dir, p2, 12)
        local, tier = cached(a2)
        assert local + tier >= (len(p1) + 12 - 1) // PAGE * PAGE
        assert tier > 0

        # Redeploy in other shapes and the other staging kind (new processes,
        # empty pools): every hit now comes from the tier, host -> GPU pinned
        # bounce on prefill TP=2, host -> GPU memory on decode.
        cluster.redeploy("prefill", PoolConfig(tp=2, device="cuda:0", staging="pinned"))
        cluster.redeploy("decode", PoolConfig(device=decode_gpu(), staging="pinned"))
        p3 = p2 + tokens_of(a2) + rng_tokens(13, 40)
        a3 = complete(url, p3, 12)
        assert tokens_of(a3) == generate_on_gpu(model_dir, p3, 12)
        local, tier = cached(a3)
        assert local == 0 and tier == (len(p2) + 12 - 1) // PAGE * PAGE

        s = stats(url)
        assert s["errors"] == 0 and s["completed"] == 3
    finally:
        cluster.stop()
