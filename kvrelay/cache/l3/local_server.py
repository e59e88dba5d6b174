"""Valkey or Redis servers started on this machine, on loopback free ports: one
server, or a cluster of primaries with replicas created by the server's own
CLI (`--cluster create`). For tests and for `kvrelay bench cache --l3
valkey-cluster` when no address is given; deployments run their own."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from kvrelay.ports import free_port
from kvrelay.procfs import die_with_parent

BINARIES = ("valkey-server", "redis-server")


def find_server_binary() -> str | None:
    """valkey-server (preferred) or redis-server on PATH, or None."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _required_binary() -> str:
    path = find_server_binary()
    if path is None:
        raise RuntimeError(
            "no valkey-server or redis-server on PATH (apt-get install redis-server)"
        )
    return path


def ping(port: int, timeout: float = 0.5) -> bool:
    """True when a Valkey/Redis server on this loopback port answers PING in time."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class LocalServer:
    def __init__(self, directory: Path, binary: str | None = None) -> None:
        self.binary = binary or _required_binary()
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.extra_args: list[str] = []

    def start(self, timeout: float = 10.0) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--dir", str(self.directory),
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
                "--logfile", str(self.directory / "server.log"),
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # A bench or test killed outright takes its servers with it.
            preexec_fn=die_with_parent(),
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.directory / "server.log").read_text(errors="replace")
                raise RuntimeError(f"{self.binary} exited {self.process.returncode}: {log[-2000:]}")
            if ping(self.port, 0.2):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer PING within {timeout} s")

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.kill()
        self.process.wait(timeout=10)
        self.process = None


# Short enough that a failover finishes in a couple of seconds.
NODE_TIMEOUT_MS = 500


def cli_binary(server: str) -> str:
    """The CLI shipped beside `server` (valkey-cli for valkey-server, else redis-cli)."""
    name = "valkey-cli" if Path(server).name.startswith("valkey") else "redis-cli"
    path = shutil.which(name, path=str(Path(server).parent)) or shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found beside {server}")
    return path


class ClusterNode(LocalServer):
    def __init__(self, directory: Path, binary: str | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        super().__init__(directory, binary)
        self.extra_args = [
            "--cluster-enabled", "yes",
            # A bus port of its own: the default (port + 10000) may be taken or too high.
            "--cluster-port", str(free_port()),
            "--cluster-config-file", str(directory / "nodes.conf"),
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            # A replica may take over however stale it is: a test kills primaries.
            "--cluster-replica-validity-factor", "0",
            "--cluster-require-full-coverage", "no",
            # Replicas sync at once (the default waits 5 s for more replicas).
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def role(self) -> str:
        return self.client().execute_command("ROLE")[0].decode()


class LocalCluster:
    def __init__(
        self, directory: Path, primaries: int = 3, replicas: int = 1, binary: str | None = None
    ) -> None:
        self.binary = binary or _required_binary()
        self.nodes = [
            ClusterNode(directory / f"node{i}", self.binary)
            for i in range(primaries * (1 + replicas))
        ]
        self.replicas = replicas

    @property
    def url(self) -> str:
        return "valkey-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def start(self, timeout: float = 30.0) -> None:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [cli_binary(self.binary), "--cluster", "create",
                 *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout,
            )  # fmt: skip
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise

    def running(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.process is not None]

    def wait_ok(self, timeout: float = 30.0, replicas: bool = True) -> None:
        """Until every running node reports the cluster ok with every slot on a running
        primary and (unless `replicas` is False) every running replica's link to its
        primary up: a creation, a failover or a rejoin has settled."""
        deadline = time.monotonic() + timeout
        while not self._settled(replicas):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not settled within {timeout} s")
            time.sleep(0.05)

    def _settled(self, need_replicas: bool) -> bool:
        running = {n.port for n in self.running()}
        try:
            for node in self.running():
                client = node.client()
                if client.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                    return False
                slots = client.execute_command("CLUSTER SLOTS")
                if sum(end - start + 1 for start, end, *_ in slots) != 16384:
                    return False
                if any(primary[1] not in running for _, _, primary, *_ in slots):
                    return False
                replication = client.info("replication")
                if (
                    need_replicas
                    and replication["role"] == "slave"
                    and replication.get("master_link_status") != "up"
                ):
                    return False
        except (redis.RedisError, OSError):
            return False
        return True

    def primaries(self) -> list[ClusterNode]:
        return [n for n in self.running() if n.role() == "master"]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def local_l3(url: str) -> Iterator[str]:
    """`url` itself, or for `valkey-cluster` without an address a local cluster of
    three primaries with a replica each, started in a temporary directory for the
    `with` block and stopped after it: its `valkey-cluster://...` URL."""
    if url != "valkey-cluster":
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="kvrelay-valkey-cluster-") as directory:
        cluster = LocalCluster(Path(directory))
        cluster.start()
        try:
            yield cluster.url
        finally:
            cluster.stop()
