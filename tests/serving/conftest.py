"""Real processes on loopback: cache servers (`kvrelay launch cache`), prefill
and decode workers (`kvrelay launch prefill|decode`), a fake control."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys

import pytest

from kvrelay.model import Request, load_engine
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec
from tests.serving import fake_control as fc
from tests.serving.fake_control import TOKEN, FakeControl

PAGE = 16
DTYPE = "float64"  # TP/PP configs agree with TP=1 to rounding; greedy ties stay put
START_TIMEOUT_S = 120


class Process:
    """A kvrelay server process that prints one JSON line when ready.

    `wait=False` returns as soon as it is started, so that a cluster's
    processes import torch and load their models side by side; `info` (or
    `ready()`) then waits for the line."""

    def __init__(self, args: list[str], env: dict | None = None, wait: bool = True) -> None:
        self.args = args
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.cli", *args],
            stdout=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        self._info: dict | None = None
        if wait:
            self.ready()

    def ready(self) -> dict:
        if self._info is None:
            ready, _, _ = select.select([self.process.stdout], [], [], START_TIMEOUT_S)
            line = self.process.stdout.readline() if ready else b""
            if not line:
                self.process.kill()
                self.process.wait(10)
                raise RuntimeError(f"{self.args[:2]} did not start within {START_TIMEOUT_S} s")
            self._info = json.loads(line)
        return self._info

    @property
    def info(self) -> dict:
        return self.ready()

    @property
    def pid(self) -> int:
        return self.process.pid

    def terminate(self, sig=signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        self.terminate(sig)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.process.stdout.close()
        return self.process.returncode


def all_ready(processes) -> None:
    """Waits for each of `processes` (started with `wait=False`) to be ready."""
    for process in processes:
        process.ready()


@pytest.fixture(scope="session")
def model_dir(model_dirs):
    return model_dirs("serving")


@pytest.fixture(scope="session")
def page_bytes(model_dir):
    return kv_spec(model_dir, ModelConfig.from_dir(model_dir), DTYPE, PAGE).page_bytes


@pytest.fixture(scope="module")
def control():
    fake = FakeControl()
    yield fake
    fake.close()


@pytest.fixture(scope="module")
def launch(control):
    """Starts processes; stops whatever is still running at the end of the
    module, while control still answers (workers deregister on SIGTERM)."""
    started: list[Process] = []

    def start(*args, env=None, wait=True) -> Process:
        process = Process([str(a) for a in args], env, wait)
        started.append(process)
        return process

    yield start
    # All at once: each one's shutdown (deregister, drain, stop its ranks)
    # then overlaps the others'.
    for process in reversed(started):
        process.terminate()
    for process in reversed(started):
        process.stop()


def cache_args(page_bytes: int, backend: str = "tcp") -> list:
    return ["launch", "cache", "--token", TOKEN, "--page-bytes", page_bytes,
            "--arena-gb", 256 * page_bytes / (1 << 30), "--backend", backend]  # fmt: skip


def worker_args(role, model_dir, control, *, tp=1, pp=1, cache=(), backend="tcp", extra=()):
    args = ["launch", role, "--model", model_dir, "--tp", tp, "--pp", pp,
            "--control", control.url, "--token", TOKEN, "--backend", backend,
            "--num-pages", 128, "--page-size", PAGE, "--dtype", DTYPE,
            "--transfer-timeout-s", 5, *extra]  # fmt: skip
    if cache:
        args += ["--cache", ",".join(cache)]
    return args


@pytest.fixture(scope="module")
def reference(model_dir):
    """Monolithic generation in this process: what the workers must reproduce."""
    engine = load_engine(model_dir, dtype=DTYPE, page_size=PAGE, num_pages=128)

    def generate(tokens, sampling: dict) -> list[int]:
        engine.pool.clear_cache()
        params = fc.sampling_params(sampling)
        return engine.generate([Request(list(tokens), params)])[0].tokens

    return generate
