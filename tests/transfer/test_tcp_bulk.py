"""The tcp backend's bulk move: runs as a C iovec array handed to readv /
writev on a blocking socket (partial calls, more runs than one call takes),
the request / answer exchange on the worker thread, and its failures. Pulls
between real processes are in test_multiprocess.py; these drive the same
functions over a socket pair, with a thread as the peer."""

import asyncio
import hashlib
import random
import socket
import struct
import threading

import numpy as np
import pytest

from kvrelay import rpc
from kvrelay.rpc.agent_ops import Accepted, Read
from kvrelay.rpc.framing import encode
from kvrelay.rpc.messages import Error
from kvrelay.transfer import PeerError, RunOutOfBounds, create_agent
from kvrelay.transfer.arena import Arena
from kvrelay.transfer.backends import tcp
from kvrelay.transfer.lease import RunLease, covers
from tests.transfer.peer import NAMESPACE, TOKEN, pattern


def test_adjacent_runs_merge_into_one_buffer():
    runs = np.array([[0, 4], [4, 4], [16, 8], [24, 1], [40, 2]], dtype=np.uint64)
    assert tcp.merge_adjacent(runs).tolist() == [[0, 8], [16, 9], [40, 2]]
    assert tcp.merge_adjacent(runs[:0]).shape == (0, 2)


def test_iovecs_stay_inside_the_arena():
    arena = Arena.allocate_private(1, 1 << 16)
    iov = tcp.iovecs(arena, np.array([[0, 16], [100, 4]], dtype=np.uint64))
    assert iov.tolist() == [[arena.address, 16], [arena.address + 100, 4]]
    for bad in ([[(1 << 16) - 4, 8]], [[2**64 - 8, 16]]):
        with pytest.raises(RunOutOfBounds):
            tcp.iovecs(arena, np.array(bad, dtype=np.uint64))
    arena.close()
    with pytest.raises(ValueError, match="no host memory"):
        tcp.iovecs(arena, np.array([[0, 16]], dtype=np.uint64))


def test_lease_covers_the_union_of_its_runs():
    lease = RunLease(1, 1, ((40, 10), (0, 8), (8, 4), (20, 5), (22, 10)), 0.0)
    inside = [[0, 12], [2, 3], [20, 12], [40, 10], [23, 1]]
    outside = [[0, 13], [12, 1], [19, 2], [30, 3], [45, 6], [60, 1]]
    for run in inside:
        assert covers(lease, np.array([run], dtype=np.uint64)), run
    for run in outside:
        assert not covers(lease, np.array([run], dtype=np.uint64)), run
    assert covers(lease, np.array(inside, dtype=np.uint64))
    assert not covers(lease, np.array([*inside, outside[0]], dtype=np.uint64))
    assert not covers(RunLease(2, 1, (), 0.0), np.array([[0, 1]], dtype=np.uint64))


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a loopback TCP connection (what the backend runs on)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname(), timeout=10)
        b, _ = server.accept()
    a.settimeout(None)
    return a, b


def _scattered(arena_size, count, run, seed):
    slots = random.Random(seed).sample(range(arena_size // (2 * run)), count)
    return np.array([(2 * run * s, run) for s in slots], dtype=np.uint64)


def test_more_runs_than_one_call_takes_move_bit_for_bit():
    # 3000 scattered runs on both sides (readv / writev take 1024 at most),
    # through socket buffers far smaller than the bytes: every call partial.
    size, run = 4 << 20, 512
    src, dst = Arena.allocate_private(1, size), Arena.allocate_private(2, size)
    src.tensor.copy_(torch_random(size))
    src_runs, dst_runs = _scattered(size, 3000, run, 1), _scattered(size, 3000, run, 2)
    a, b = tcp_pair()
    for sock, option in ((a, socket.SO_SNDBUF), (b, socket.SO_RCVBUF)):
        sock.setsockopt(socket.SOL_SOCKET, option, 64 << 10)
    sender = threading.Thread(
        target=tcp._blocking, args=(a, tcp.move_iovecs, tcp.iovecs(src, src_runs), False)
    )
    sender.start()
    tcp._blocking(b, tcp.move_iovecs, tcp.iovecs(dst, dst_runs), True)
    sender.join(10)
    for (s, n), (d, _) in zip(src_runs.tolist(), dst_runs.tolist(), strict=True):
        assert bytes(dst.buffer(d, n)) == bytes(src.buffer(s, n))
    assert not a.getblocking() and not b.getblocking()  # handed back non-blocking
    a.close(), b.close()


def torch_random(size):
    import torch

    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator())


def frame(message) -> bytes:
    body = encode(message)
    return struct.pack(">I", len(body)) + body


class FakeOwner(threading.Thread):
    """Reads one request frame, then does `act(sock)`."""

    def __init__(self, sock, act):
        super().__init__(daemon=True)
        self.sock, self.act = sock, act

    def run(self):
        self.sock.setblocking(True)
        tcp._recv_frame(self.sock)
        self.act(self.sock)


def _exchange(owner_act, nbytes=4096):
    reader, owner = tcp_pair()
    local = Arena.allocate_private(1, nbytes)
    FakeOwner(owner, owner_act).start()
    reader.sendall(frame(Read(1, 1, b"")))
    iov = tcp.iovecs(local, np.array([[0, nbytes]], dtype=np.uint64))
    try:
        tcp._blocking(reader, tcp._answer_and_move, nbytes, iov, True)
    finally:
        reader.close()
        owner.close()
    return local


def test_the_reader_takes_the_owner_answer_and_the_bytes():
    payload = bytes(range(256)) * 16
    local = _exchange(lambda s: s.sendall(frame(Accepted(4096)) + payload))
    assert bytes(local.buffer(0, 4096)) == payload


def test_a_refusal_a_wrong_count_and_a_dead_owner_fail_the_pull():
    refusal = frame(Error("LeaseExpired", "gone"))
    with pytest.raises(rpc.RemoteError, match="gone"):
        _exchange(lambda s: s.sendall(refusal))
    with pytest.raises(PeerError, match="accepted 4095 bytes"):
        _exchange(lambda s: s.sendall(frame(Accepted(4095))))
    with pytest.raises(PeerError, match="closed"):  # dies after half the bytes
        _exchange(lambda s: (s.sendall(frame(Accepted(4096)) + b"x" * 2048), s.close()))


def test_an_owner_that_stops_sending_fails_after_the_stall_limit(monkeypatch):
    monkeypatch.setattr(tcp, "_STALL_S", 0.3)
    stop = threading.Event()
    with pytest.raises(PeerError, match="moved no byte"):
        _exchange(lambda s: (s.sendall(frame(Accepted(4096)) + b"x"), stop.wait(5)))
    stop.set()


@pytest.mark.asyncio
async def test_a_cancelled_move_writes_nothing_afterwards():
    reader, owner = tcp_pair()
    reader.setblocking(False)
    local = Arena.allocate_private(1, 1 << 20)
    iov = tcp.iovecs(local, np.array([[0, 1 << 20]], dtype=np.uint64))
    task = asyncio.create_task(tcp.in_thread(reader, tcp.move_iovecs, iov, True))
    owner.sendall(b"\x01" * 1000)
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    owner.settimeout(10)
    with pytest.raises(OSError):  # shut down: no byte can reach the arena any more
        for _ in range(64):
            owner.sendall(b"\x02" * (1 << 20))
    assert bytes(local.buffer(0, 1000)) == b"\x01" * 1000
    assert not any(local.buffer(1000, (1 << 20) - 1000))
    reader.close(), owner.close()


@pytest.mark.asyncio
async def test_a_peer_process_serves_more_runs_than_one_call_takes(start_peer):
    # Between real processes: 1500 scattered runs (readv / writev take 1024)
    # pulled into scattered places, then pushed back elsewhere, bit for bit.
    size, run = 4 << 20, 1024
    runs = _scattered(size, 1500, run, 3)
    peer = start_peer("tcp", size, [runs.tolist()])
    expected = peer_pattern(size)
    local_at = _scattered(size, 1500, run, 4)[:, 0].tolist()
    async with await create_agent("tcp", token=TOKEN, fast_path=False) as agent:
        local = agent.allocate_arena(size)
        await agent.read(peer.handles[0], local, local_at, namespace=NAMESPACE, timeout=30)
        for (remote, n), at in zip(runs.tolist(), local_at, strict=True):
            assert bytes(local.buffer(at, n)) == expected[remote : remote + n]
        local.tensor.copy_(torch_random(size))
        await agent.write(peer.handles[0], local, local_at, namespace=NAMESPACE, timeout=30)
        pushed = bytearray(expected)
        for (remote, n), at in zip(runs.tolist(), local_at, strict=True):
            pushed[remote : remote + n] = local.buffer(at, n)
    assert peer.digest() == hashlib.sha256(pushed).digest()


def peer_pattern(size: int) -> bytes:
    return pattern(size, 0).numpy().tobytes()


def _drain(sock, n):
    sock.setblocking(True)
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


@pytest.mark.parametrize("full_buffer", [False, True])
def test_the_owner_loop_sends_the_answer_and_the_first_bytes(full_buffer):
    # `send_some` on a non-blocking socket sends the head and at most `limit`
    # bytes of the runs (all of it, or nothing when the socket takes no byte);
    # the rows it returns carry the rest of the same stream, bit for bit.
    size, run = 1 << 20, 4096
    src = Arena.allocate_private(1, size)
    src.tensor.copy_(torch_random(size))
    runs = _scattered(size, 100, run, 5)
    expected = b"".join(bytes(src.buffer(s, n)) for s, n in runs.tolist())
    head = np.frombuffer(b"HEAD" * 5, dtype=np.uint8)
    owner, reader = tcp_pair()
    owner.setblocking(False)
    filler = b""
    if full_buffer:
        owner.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        with pytest.raises(BlockingIOError):
            while True:
                filler += b"f" * owner.send(b"f" * 4096)
    rest = tcp.send_some(owner, head, tcp.iovecs(src, runs), 10_000)
    sent = head.nbytes + len(expected) - int(rest[:, 1].sum())
    if full_buffer:  # nothing, unless an ACK freed some room meanwhile
        assert sent <= head.nbytes + 10_000
    else:
        assert sent == head.nbytes + 10_000
    sender = threading.Thread(target=tcp._blocking, args=(owner, tcp.move_iovecs, rest, False))
    sender.start()
    stream = _drain(reader, len(filler) + head.nbytes + len(expected))
    sender.join(10)
    assert stream == filler + head.tobytes() + expected
    owner.close(), reader.close()


@pytest.mark.asyncio
async def test_an_owner_failing_mid_pull_fails_the_reader_at_once(monkeypatch):
    # Past its answer the owner cannot send a typed refusal (it would land
    # among the bytes and the reader would wait for its deadline): it shuts
    # the connection down, and the reader fails with PeerError, not a timeout.
    size = 4 << 20  # more than the owner's loop sends itself
    real_move = tcp.move_iovecs

    def failing_sender(sock, iov, receive):
        if not receive:
            raise RuntimeError("the arena went away")
        real_move(sock, iov, receive)

    monkeypatch.setattr(tcp, "move_iovecs", failing_sender)
    async with (
        await create_agent("tcp", token=TOKEN, fast_path=False) as owner,
        await create_agent("tcp", token=TOKEN, fast_path=False) as reader,
    ):
        handle = owner.publish(owner.allocate_arena(size), [(0, size)], NAMESPACE)
        local = reader.allocate_arena(size)
        with pytest.raises(PeerError, match=r"closed|lost"):
            await reader.read(handle, local, [0], namespace=NAMESPACE, timeout=60)
        monkeypatch.setattr(tcp, "move_iovecs", real_move)
        await reader.read(handle, local, [0], namespace=NAMESPACE, timeout=60)  # reconnects
