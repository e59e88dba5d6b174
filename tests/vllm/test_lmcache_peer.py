"""LMCache as `kvrelay bench vllm`'s reuse peer, for real: the bench (as run
from the main venv) starts LMCache's own server and two vLLM engines with
`LMCacheMPConnector`, all from LMCache's environment (`make lmcache-deps`),
on a tiny random Llama. Skipped, saying why, without that environment;
`make test-peers-vllm` builds it and runs this file."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrelay import procfs

ROOT = Path(__file__).resolve().parents[2]
LMCACHE_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
BENCH_PYTHON = ROOT / ".venv" / "bin" / "python"  # where `kvrelay bench` runs (make setup)
TINY = ["--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "2",
        "--decode-tokens", "4", "--parts", "reuse", "--reuse-connectors", "lmcache"]  # fmt: skip

pytestmark = pytest.mark.skipif(
    not LMCACHE_PYTHON.exists(),
    reason=f"no {LMCACHE_PYTHON}: LMCache's environment is built by `make lmcache-deps`",
)


def _bench(*extra: str) -> list[str]:
    return [str(BENCH_PYTHON), "-m", "kvrelay.cli", "bench", "vllm",
            "--vllm-python", sys.executable, *TINY, *extra]  # fmt: skip


def test_a_fresh_engine_takes_full_chunks_from_lmcache_and_answers_as_the_cold_one(tmp_path):
    # 300 tokens: one full 256-token chunk stored, the 44 past it recomputed;
    # 512: both chunks stored, vLLM recomputes the last prompt token itself.
    out = tmp_path / "bench.json"
    done = subprocess.run(_bench("--reuse-sizes", "300,512", "--json", str(out),
                                 "--out", str(tmp_path / "logs")),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    lmcache = result["reuse_peers"]["lmcache"]
    assert {s: v["cached"] for s, v in lmcache["per_size"].items()} == {"300": 256, "512": 511}
    assert lmcache["outputs_equal"] and result["outputs_equal"]
    assert all(v["ttft_cold_s"] > 0 and v["ttft_hit_s"] > 0 for v in lmcache["per_size"].values())
    assert lmcache["setup"]["server_command"][0] == "server"  # LMCache's own CLI ran it
    assert "reuse" not in result  # kvrelay's reuse was not asked for


def _alive(pid: int) -> bool:
    fields = procfs.stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name
)
def test_a_bench_stopped_mid_run_leaves_no_lmcache_server_or_engine_running(tmp_path, sig):
    # Stopped while its engines start, the bench stops them and the LMCache
    # server as on a normal exit (SIGKILL: they get SIGTERM as it dies).
    bench = subprocess.Popen(_bench("--reuse-sizes", "300", "--out", str(tmp_path)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        started: list[int] = []
        while time.monotonic() < deadline and bench.poll() is None:
            started = procfs.descendants(bench.pid)
            if any("kvrelay.bench.vllm_engine" in _cmdline(p) for p in started):
                break
            time.sleep(0.2)
        commands = {p: _cmdline(p) for p in started}
        assert any(" server " in c and "lmcache" in c for c in commands.values()), commands
        assert any("kvrelay.bench.vllm_engine" in c for c in commands.values()), commands
        time.sleep(2.0)  # the engines are importing vLLM
        started = procfs.descendants(bench.pid)
        bench.send_signal(sig)
        bench.wait(120)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not {p: _cmdline(p) for p in started if _alive(p)}
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
