"""A real Valkey or Redis Cluster on loopback free ports, for tests: primaries with
one replica each, created by the server's own CLI (`--cluster create`)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from tests.cache.l3.valkey_server import ValkeyServer, free_port, server_binary

# Short enough that a failover finishes in a couple of seconds.
NODE_TIMEOUT_MS = 500


def cli_binary(server: str) -> str:
    """The CLI shipped beside `server` (valkey-cli for valkey-server, else redis-cli)."""
    name = "valkey-cli" if Path(server).name.startswith("valkey") else "redis-cli"
    path = shutil.which(name, path=str(Path(server).parent)) or shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found beside {server}")
    return path


class ClusterNode(ValkeyServer):
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        super().__init__(directory)
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


class ValkeyCluster:
    def __init__(self, directory: Path, primaries: int = 3, replicas: int = 1) -> None:
        self.binary = server_binary()
        self.nodes = [
            ClusterNode(directory / f"node{i}") for i in range(primaries * (1 + replicas))
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
