"""Mooncake Store as `kvrelay bench sglang`'s peer: its master on
loopback, SGLang's own mooncake backend over a real host pool, and the bench's
mooncake columns; and as `kvrelay bench sglang-server`'s modes across a
redeploy. Skipped where `make peers-deps` has not installed it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvrelay.bench import sglang_mooncake as mooncake
from kvrelay.bench.sglang import MOONCAKE_SETTINGS, ROWS
from tests.adapters import sglang_env as env
from tests.adapters.test_sglang_server_bench import bench_redeploy

pytestmark = pytest.mark.skipif(mooncake.missing() is not None, reason=str(mooncake.missing()))

PAGES, RUNS = 5, 2


def _listeners(pid: int) -> list[str]:
    """The local addresses process `pid` listens on (tcp), by `ss -ltnp`."""
    out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def test_sglang_mooncake_backend_round_trips_pages_and_the_master_stops():
    master = mooncake.MasterProcess(timeout_s=30)
    try:
        if shutil.which("ss"):
            listening = _listeners(master.popen.pid)
            assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening
        pool = env.mha_pool("page_first", heads=2, layers=2, start_layer=0, page_size=4,
                            head_dim=8, dtype=torch.bfloat16)  # fmt: skip
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator()))
        segment = mooncake.MIN_SEGMENT_BYTES
        backend = mooncake.create_backend(
            master, pool, layout="page_first", model="test/mooncake", global_segment_bytes=segment
        )
        try:
            assert mooncake.fill_segment(master, backend, pool, segment) > 0
            keys = env.sglang_keys(list(range(16)), 4)
            idx = torch.arange(16, dtype=torch.int64)
            assert backend.batch_exists(keys) == 0  # remove_all after the fill
            assert all(backend.batch_set_v1(keys, idx))
            want = pool.kv_buffer.clone()
            pool.kv_buffer.zero_()
            assert all(backend.batch_get_v1(keys, idx))
            assert torch.equal(pool.kv_buffer[:, :16], want[:, :16])
            missing = env.sglang_keys(list(range(100, 104)), 4)
            assert not any(backend.batch_get_v1(missing, torch.arange(4, dtype=torch.int64)))
            # Just read, the pages are leased: emptying waits them out
            assert master.key_count() > 0
            master.empty(backend)
            assert master.key_count() == 0 and backend.batch_exists(keys) == 0
        finally:
            mooncake.close_backend(backend)
    finally:
        master.stop()
    assert master.popen.returncode is not None


def _ucx_built() -> bool:
    try:
        from kvrelay.transfer.backends import ucx  # noqa: F401
    except Exception:  # BackendUnavailable: kvrelay._ucx was not built here
        return False
    return True


def test_bench_sglang_races_mooncake_beside_kvrelay_and_file(tmp_path):
    out = tmp_path / "sglang.json"
    sizes = ["--page-size", "4", "8", "--layers", "2", "--heads", "2", "--head-dim", "8"]
    transports = ["tcp", "ucx"] if _ucx_built() else ["tcp"]
    sizes += ["--transport", *transports]
    command = [sys.executable, "-m", "kvrelay.cli", "bench", "sglang", "--pages", str(PAGES),
               *sizes, "--batch", "2", "--servers", "1", "--runs", str(RUNS),
               "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["peers"]["mooncake"]["protocol"] == "tcp"
    assert [s["page_bytes"] for s in result["sizes"]] == [512, 1024]
    for size in result["sizes"]:
        ucx_rows = {"kvrelay-ucx set", "kvrelay-ucx get"} if "ucx" in transports else set()
        mooncake_rows = {f"{name} {op}" for name in MOONCAKE_SETTINGS for op in ("set", "get")}
        assert set(size["rows"]) == {*ROWS, *mooncake_rows, *ucx_rows}
        assert size["byte_check"]["mooncake_pages"] == PAGES * RUNS
        assert size["byte_check"]["mooncake_holder_pages"] == PAGES * RUNS
        assert size["mooncake"]["segment_in"] == "rank"
        assert size["mooncake_holder"]["segment_in"] == "holder process"
        for store in ("kvrelay", "mooncake", "mooncake_holder", "file"):
            assert size[store]["set_gbps"] > 0 and size[store]["get_gbps"] > 0
        assert list(size["kvrelay_transports"]) == transports
        assert size["kvrelay"] in size["kvrelay_transports"].values()
    host = result["peers"]["mooncake"]["master"]
    alive = subprocess.run(["pgrep", "-f", f"rpc_port={host.split(':')[1]}"],
                           capture_output=True, timeout=10)  # fmt: skip
    assert alive.returncode == 1, "the bench's mooncake_master outlived it"
    holders = subprocess.run(["pgrep", "-f", "kvrelay.bench.sglang_mooncake 127.0.0.1:"],
                             capture_output=True, timeout=10)  # fmt: skip
    assert holders.returncode == 1, "a Mooncake segment holder outlived the bench"


def _children_named(pid: int, name: str) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid), name], capture_output=True, text=True,
                           timeout=10)  # fmt: skip
    return [int(p) for p in found.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_bench_stops_its_mooncake_master_on_a_signal(sig):
    command = [sys.executable, "-m", "kvrelay.cli", "bench", "sglang", "--pages", "16",
               "--page-size", "4", "--layers", "2", "--heads", "2", "--head-dim", "8",
               "--servers", "1", "--runs", "1000000"]  # fmt: skip
    bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, masters = time.monotonic() + 120, []
        while not masters and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            masters = _children_named(bench.pid, "mooncake_master")
        assert masters, "the bench started no mooncake_master"
        time.sleep(2)  # into the timed runs
        bench.send_signal(sig)
        bench.wait(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(masters[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(masters[0]), "the bench's mooncake_master outlived it"


def test_after_a_tp_redeploy_only_a_segment_holder_keeps_mooncake_pages(tmp_path):
    """TP=2 then TP=1 servers: SGLang's default setting (each rank mounts a
    segment) loses its pages with the ranks; a segment holder keeps them, and
    SGLang's `tp_lcm_size` keys them by head shards that TP=1 reads."""
    after = bench_redeploy(tmp_path, ["mooncake", "mooncake-holder"])
    assert after["mooncake"]["x_optimum"] < 0.5
    assert after["mooncake-holder"]["x_optimum"] >= 0.95
    held = after["l3_held"]["mooncake-holder"]
    assert held["after"] >= held["before"] > 0
