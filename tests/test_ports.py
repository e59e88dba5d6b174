"""Free ports come from below the kernel's ephemeral range, where no
outgoing connection or `bind(0)` can take them before their server binds."""

import socket

from kvrelay.ports import _ephemeral_range, free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    lo, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn at random, not one fixed port
    for port in ports:
        assert 10000 <= port < min(lo, 22000)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_handed_out():
    held = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        assert len({s.getsockname()[1] for s in held}) == len(held)
    finally:
        for s in held:
            s.close()
