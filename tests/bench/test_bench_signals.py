"""Servers a bench or test starts do not outlive it: a bench stopped by a
signal mid-run, and a test process killed outright."""

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrelay import procfs
from tests.bench.test_cache_bench import write_trace
from tests.cache.l3.valkey_server import server_binary


def _alive(pid: int) -> bool:
    fields = procfs.stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_bench_stopped_mid_run_leaves_no_server_running(tmp_path, sig):
    # `--l3 valkey-cluster` starts six redis-server processes; stopped by a
    # signal while it replays, the bench stops them as on a normal exit
    # (SIGKILL: they get SIGTERM as their parent dies).
    server_binary()  # skipped without one (outside CI)
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, 400)
    scratch = tmp_path / "tmp"  # where the cluster's directory goes
    scratch.mkdir()
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvrelay.cli", "bench", "cache", "--trace", str(trace),
         "--l3", "valkey-cluster", "--workers", "2", "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(scratch)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        servers: list[int] = []
        while len(servers) < 6 and time.monotonic() < deadline and bench.poll() is None:
            servers = [
                p for p in procfs.descendants(bench.pid)
                if "server" in Path(f"/proc/{p}/comm").read_text(errors="replace")
            ]  # fmt: skip
            time.sleep(0.1)
        assert len(servers) == 6, servers
        time.sleep(1.0)  # into the replay
        bench.send_signal(sig)
        bench.wait(30)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in servers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in servers if _alive(p)]
        if sig != signal.SIGKILL:  # its temporary directory went too
            assert not list(scratch.iterdir())
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)


def test_a_cache_server_does_not_outlive_the_process_that_started_it(tmp_path):
    # A test process killed outright (no fixture teardown) takes its cache
    # servers with it.
    script = (
        "import sys, time\n"
        "from tests.cache.server_process import ServerProcess\n"
        "server = ServerProcess()\n"
        "print(server.process.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([owner.stdout], [], [], 60)
        assert ready
        server = int(owner.stdout.readline())
        assert _alive(server)
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 20
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        owner.stdout.close()
