"""Mooncake Store as `kvrelay bench sglang`'s peer.

Set up as SGLang's `--hicache-storage-backend mooncake` sets it up by default:
SGLang's own `MooncakeStore`, made by its `StorageBackendFactory` over a real
host pool, each rank contributing a global segment to the store and moving
pages with the zero-copy batch calls (`batch_put_from` / `batch_get_into`)
on buffers registered from the pool. One `mooncake_master` process, started
here on loopback (rpc and metrics on 127.0.0.1); metadata by
`P2PHANDSHAKE`, SGLang's default, with no metadata server: Mooncake
0.3.13.post1's HTTP metadata server listens on every interface whatever
`--http_metadata_server_host` says. The transfer engine speaks tcp (no RDMA
here). `MC_TCP_BIND_ADDRESS=127.0.0.1` is set, but this version's client
still listens on every interface (`ss -ltnp`) for its transfer-engine RPC
and tcp transport ports; neither that variable nor `local_hostname` narrows
them.
"""

from __future__ import annotations

import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvrelay.ports import free_port
from kvrelay.procfs import die_with_parent, end_process

# Mooncake's client refuses a global segment under 16 MiB ("Total size must be at least").
MIN_SEGMENT_BYTES = 16 << 20

# Mooncake reads this when its transfer engine starts: set before the first setup().
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


def missing() -> str | None:
    """Why the Mooncake peer cannot run here, or None when it can."""
    try:
        import mooncake
        import mooncake.store  # links libibverbs.so.1 (apt's libibverbs1)
    except ImportError as exc:
        return f"Mooncake Store cannot be imported ({exc}); install it with `make peers-deps`"
    if not (Path(mooncake.__file__).parent / "mooncake_master").is_file():
        return "the mooncake package has no mooncake_master binary"
    return None


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class MasterProcess:
    """`mooncake_master` on 127.0.0.1: master (rpc) and metrics servers.

    The process gets SIGTERM when this one dies however it dies (die_with_parent),
    and `stop()` ends it on every normal path (the bench's ExitStack; the CLI
    turns SIGTERM into an unwind like SIGINT's).
    """

    def __init__(self, timeout_s: float = 30.0) -> None:
        import mooncake

        binary = Path(mooncake.__file__).parent / "mooncake_master"
        self.rpc_port, self.metrics_port = (free_port() for _ in range(2))
        # Open for the process's life, closed (and removed) by stop().
        self.log = tempfile.NamedTemporaryFile(prefix="kvrelay-mooncake-", suffix=".log")  # noqa: SIM115
        command = [
            str(binary),
            "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
        ]  # fmt: skip
        self.popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),
        )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not _listening(self.rpc_port):
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited ({self.popen.returncode}): {self.tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"mooncake_master not listening after {timeout_s:.0f} s: {self.tail()}"
                )
            time.sleep(0.1)

    def tail(self, chars: int = 2000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return "P2PHANDSHAKE"

    def extra_config(self, global_segment_bytes: int) -> dict:
        """SGLang's mooncake extra config for this master, as a server takes it
        (`--hicache-storage-backend-extra-config`)."""
        return {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": global_segment_bytes,
            "local_hostname": "127.0.0.1",
            "master_metrics_port": self.metrics_port,
        }

    def key_count(self) -> int | None:
        """Keys the master holds now (its `master_key_count` gauge), None unread."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            return None
        match = re.search(r"^master_key_count (\S+)$", text, re.MULTILINE)
        return int(float(match.group(1))) if match else None

    def empty(self, backend, timeout_s: float = 30.0) -> None:
        """`remove_all` until the master holds no key: an object put or read
        within its lease (`default_kv_lease_ttl`, 10 s) survives a remove_all,
        and the next run's puts would then find the segment full."""
        deadline = time.monotonic() + timeout_s
        while True:
            backend.clear()
            if self.key_count() == 0:
                return
            if time.monotonic() > deadline:
                left = self.key_count()
                raise TimeoutError(f"Mooncake still holds {left} keys after {timeout_s:.0f} s")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 10.0) -> None:
        end_process(self.popen, timeout_s, timeout_s)
        self.log.close()


def create_backend(master: MasterProcess, pool, *, layout: str, model: str,
                   global_segment_bytes: int):  # fmt: skip
    """SGLang's MooncakeStore as its cache controller makes it: the factory with
    the host pool, then `register_mem_pool_host` (registers the pool's buffers
    for the zero-copy calls)."""
    from kvrelay.adapters.sglang import harness as h

    config = h.storage_config(layout=layout, model_name=model,
                              extra=master.extra_config(global_segment_bytes))  # fmt: skip
    backend = h.StorageBackendFactory.create_backend("mooncake", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def close_backend(backend) -> None:
    """Closes the store's client while its master still runs: SGLang's `close()`
    leaves it to the destructor, which (after the master stopped) waits seconds
    on RPCs to unmount its segment."""
    store = getattr(backend, "store", None)
    if store is not None:
        store.close()
        backend.store = None


def fill_segment(master: MasterProcess, backend, pool, global_segment_bytes: int) -> int:
    """Puts pages until the segment has been written once, then `remove_all`: a
    segment whose memory was never touched puts at a fraction of its later rate
    (first-touch page faults), which a deployed store has long paid. Returns
    the pages put."""
    page_tokens = pool.page_size
    capacity = max(1, pool.size // page_tokens)  # the whole pool per call: fewer calls
    page_bytes = pool.get_ksize_per_token() * page_tokens * 2  # K and V objects
    put, target = 0, global_segment_bytes // page_bytes + capacity
    while put < target:
        n = min(capacity, target - put)
        keys = [f"kvrelay-bench-fill-{put + i}" for i in range(n)]
        idx = _indices(0, n, page_tokens)
        results = backend.batch_set_v1(keys, idx)
        put += n
        if not all(results):  # full: the rest would be refused too
            break
    master.empty(backend)
    return put


def _indices(first_page: int, pages: int, page_tokens: int):
    import torch

    return torch.arange(first_page * page_tokens, (first_page + pages) * page_tokens,
                        dtype=torch.int64)  # fmt: skip


class SegmentHolder:
    """A process that only mounts a global segment on `master` (Mooncake's
    second deployment form: the engine's ranks mount none, every page crosses
    to this process over the transfer engine, as kvrelay's pages cross to
    its cache servers). It dies with this process and on `stop()`."""

    def __init__(self, master: MasterProcess, segment_bytes: int, timeout_s: float = 60.0):
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.bench.sglang_mooncake", master.master_address,
             str(segment_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            preexec_fn=die_with_parent(),
        )  # fmt: skip
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout_s)
        line = self.popen.stdout.readline() if ready else ""
        if line.strip() != "mounted":
            self.stop()
            raise RuntimeError(f"Mooncake segment holder did not mount its segment: {line!r}")

    def stop(self, timeout_s: float = 10.0) -> None:
        end_process(self.popen, timeout_s, 5.0)
        for stream in (self.popen.stdin, self.popen.stdout):
            stream.close()


def _hold(master_address: str, segment_bytes: int) -> None:
    """The holder process: mount the segment, say so, serve until stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, MIN_SEGMENT_BYTES, "tcp", "",
                       master_address)  # fmt: skip
    print("mounted" if code == 0 else f"setup returned {code}", flush=True)
    if code == 0:
        sys.stdin.read()  # EOF: the bench closed the pipe or died
    store.close()


if __name__ == "__main__":
    _hold(sys.argv[1], int(sys.argv[2]))
