"""Free TCP ports for the servers tests, benches and the demo start.

A port the kernel hands out for `bind(0)` comes from the ephemeral range,
the same range every outgoing connection and every library that binds port
0 (gloo, ZMQ, UCX's sockaddr listeners) draws from. A server that takes many
seconds to import before it binds the port it was given (an SGLang server
takes ten) then finds it taken. Ports are therefore drawn at random below
the ephemeral range, where only explicit binds land, and checked free; and
below 22000, where SGLang draws the ports its ranks bind later.
"""

from __future__ import annotations

import random
import socket

_LOWEST = 10000  # below it sit well-known and registered services
_HIGHEST = 22000  # SGLang's own late-bound ports start here


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the kernel's ephemeral range when
    there is room below it (else whatever `bind(0)` gives)."""
    top = min(_ephemeral_range()[0], _HIGHEST)
    if top - _LOWEST >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_LOWEST, top)
            if _bindable(port, host):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
