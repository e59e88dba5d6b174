"""A small real cluster for the hostile-input and security tests: control,
one cache server (file L3), one prefill and one decode worker, all with
2-second hello/stall deadlines so that slow clients are dropped fast."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvrelay.chaos.cluster import ChaosCluster, ChaosConfig
from kvrelay.model import RandomModelSpec, write_model
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec

PAGE = 16
DTYPE = "float64"
MODEL = RandomModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, std=0.2, seed=21)


@pytest.fixture(scope="session")
def chaos_model(tmp_path_factory):
    model_dir = write_model(tmp_path_factory.mktemp("chaos") / "llama", MODEL)
    page_bytes = kv_spec(model_dir, ModelConfig.from_dir(model_dir), DTYPE, PAGE).page_bytes
    return model_dir, page_bytes


@pytest.fixture(scope="module")
def small_cluster(chaos_model, tmp_path_factory):
    model_dir, page_bytes = chaos_model
    config = ChaosConfig(
        model_dir=model_dir, log_dir=tmp_path_factory.mktemp("logs"), page_bytes=page_bytes,
        page_size=PAGE, dtype=DTYPE, prefill_workers=1, decode_workers=1, cache_servers=1,
        l3="file", pages=64,
    )  # fmt: skip
    cluster = ChaosCluster(config).start()
    yield cluster
    cluster.stop()


def run(coro):
    return asyncio.run(coro)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
