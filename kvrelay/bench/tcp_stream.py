"""Baseline of the tcp backend: one plain TCP stream between two processes on
loopback, blocking `sendall` / `recv_into` of the same byte count, no
protocol at all: what this host's loopback moves, measured in the same run.
Both buffers are allocated like the arenas (huge pages where allowed), and
each timed transfer starts from a cold cache like each timed pull, so the
baseline gets what the pulls get from the memory system (warm, the stream
moved 1.5-2.3 GB/s where it moved 0.9 after the sweep, tcp5's A/B). The
sender's buffer is written before it is sent, and the receiver checks what
landed: an untouched private buffer is the kernel's zero page, always in
the cache, so the baseline read no memory (on the 32 MiB batch it moved
3.5-4.7 GB/s in six invocations before the fix, 2.2-3.9 in four after)."""

from __future__ import annotations

import multiprocessing
import socket

from kvrelay.bench.stats import Summary, time_once
from kvrelay.transfer.arena import private_tensor

_PATTERN = 0x5A  # what the sender's bytes hold, checked where they land


def _sender(port_queue, nbytes: int, times: int, host: str, netns: str | None) -> None:
    if netns is not None:
        from kvrelay.bench.netns import enter

        enter(netns)
    with socket.create_server((host, 0)) as server:
        port_queue.put(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            source = private_tensor(nbytes)
            source.fill_(_PATTERN)  # real pages, not the zero page
            payload = memoryview(source.numpy())
            for _ in range(times):
                if conn.recv(1) != b"g":
                    return
                conn.sendall(payload)


def tcp_stream(
    nbytes: int, runs: int, sweep=None, timeout_s: float = 120.0,
    host: str = "127.0.0.1", sender_netns: str | None = None,
) -> Summary:  # fmt: skip
    """Seconds per transfer of `nbytes` (first transfer untimed), each after
    `sweep.add_(1)` when a sweep tensor is given (the bench's cache sweep).
    The sender listens on `host`, in network namespace `sender_netns` if given."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    sender_args = (ports, nbytes, runs + 1, host, sender_netns)
    sender = context.Process(target=_sender, args=sender_args, daemon=True)
    sender.start()
    try:
        with socket.create_connection((host, ports.get(timeout=timeout_s))) as conn:
            conn.settimeout(timeout_s)
            landed = private_tensor(nbytes)
            view = memoryview(landed.numpy())

            def once() -> None:
                conn.sendall(b"g")
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError("the sender closed the stream")
                    got += n

            once()
            times = []
            for _ in range(runs):
                if sweep is not None:
                    sweep.add_(1)
                times.append(time_once(once))
            if not bool((landed == _PATTERN).all()):
                raise RuntimeError("the TCP stream baseline did not deliver the sender's bytes")
            return Summary.of(times)
    finally:
        sender.join(timeout=10)
        if sender.is_alive():
            sender.kill()
