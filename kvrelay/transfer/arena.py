"""Arenas: registered memory regions that hold only KV pages.

An arena is either allocated by the agent in shared memory (a memfd, which a
reader on the same host maps through /proc/<pid>/fd/<fd> for the fast path,
and which the kernel frees when its last user is gone, so a SIGKILLed owner
leaks nothing), or wraps a caller's contiguous tensor (exposed to peers only
through the network backends). Either way peers can reach only [base, base +
size) and only after bounds checks.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, size: int) -> int:
    """mmap(fd) read-write and shared; returns the address."""
    # MAP_POPULATE builds the page tables up front: an arena is mapped once and
    # read for its whole life, and faulting 4 KiB pages in during a pull (the
    # host refuses huge pages for shared memory) costs more than the copy.
    flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    # Huge pages where the host allows them for shared memory
    # (transparent_hugepage/shmem_enabled = advise): copies of runs scattered
    # over a large arena then miss the TLB far less. A refusal is harmless.
    _libc.madvise(addr, size, mmap.MADV_HUGEPAGE)
    return addr


def private_tensor(size: int) -> torch.Tensor:
    """A zeroed uint8 tensor over private anonymous memory backed by transparent
    huge pages where the host allows them (transparent_hugepage/enabled =
    madvise or always)."""
    # torch's allocator gives 4 KiB pages. cma (process_vm_readv) pins and
    # walks every page of a run, and scattered copies miss the TLB per page:
    # on this host a batch of 512 x 64 KiB GETs went from 4.8 to 6.5 GB/s
    # with both arenas on huge pages. The tensor keeps the mapping alive.
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # refused: 4 KiB pages, as before
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))


_HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25  # Linux 6.1


def collapse_to_huge_pages(tensor: torch.Tensor) -> int:
    """Moves a host tensor's storage onto transparent huge pages now
    (MADV_HUGEPAGE, then MADV_COLLAPSE over its whole 2 MiB pages); returns
    the bytes collapsed, 0 where the kernel refuses (older than 6.1, THP off).

    For memory registered after someone else allocated it (an engine's KV
    cache): `private_tensor`'s reasons hold for it too, and process_vm_readv
    pins a huge page in one step where it walks 512 small ones."""
    if tensor.is_cuda:
        return 0
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (storage.data_ptr() + storage.nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return 0
    if _libc.madvise(start, end - start, mmap.MADV_HUGEPAGE) != 0:
        return 0
    if _libc.madvise(start, end - start, _MADV_COLLAPSE) != 0:
        return 0  # advised only: khugepaged collapses it later
    return end - start


def unmap(address: int, size: int) -> None:
    if _libc.munmap(address, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")


def tensor_at(address: int, size: int) -> torch.Tensor:
    """A uint8 tensor over memory this process mapped (not owned by the tensor)."""
    array = np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_uint8)), (size,))
    return torch.from_numpy(array)


@dataclass(eq=False, slots=True)
class Arena:
    """A registered region. `tensor` is the uint8 view the owner fills with pages."""

    arena_id: int
    address: int
    size: int
    tensor: torch.Tensor
    shm_path: str = ""  # where a same-host reader maps it; "" when not shared
    rkey: bytes = b""  # packed by the backend at registration
    # A caller's host tensor that same-host peers copy with process_vm_readv
    # (it cannot be mapped); private arenas keep every read with their owner.
    kernel_copy: bool = False
    _fd: int = -1
    _owns_mapping: bool = False
    closed: bool = False
    _whole: memoryview | None = None  # the arena as one byte view, made on first use

    @classmethod
    def allocate_shared(cls, arena_id: int, size: int) -> Arena:
        fd = os.memfd_create(f"kvrelay-arena-{arena_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            address = map_shared(fd, size)
        except BaseException:
            os.close(fd)
            raise
        path = f"/proc/{os.getpid()}/fd/{fd}"
        return cls(
            arena_id,
            address,
            size,
            tensor_at(address, size),
            shm_path=path,
            _fd=fd,
            _owns_mapping=True,
        )

    @classmethod
    def allocate_private(cls, arena_id: int, size: int) -> Arena:
        tensor = private_tensor(size)
        return cls(arena_id, tensor.data_ptr(), size, tensor)

    @classmethod
    def wrap(cls, arena_id: int, tensor: torch.Tensor) -> Arena:
        if not tensor.is_contiguous():
            raise ValueError("an arena tensor must be contiguous")
        flat = tensor.view(-1).view(torch.uint8)
        if flat.numel() == 0:
            raise ValueError("an arena tensor must not be empty")
        return cls(arena_id, flat.data_ptr(), flat.numel(), flat)

    @property
    def is_cuda(self) -> bool:
        return self.tensor.is_cuda

    def buffer(self, offset: int, length: int) -> memoryview:
        """A writable memoryview of [offset, offset + length) (host arenas only)."""
        if self.is_cuda:
            raise TypeError("a GPU arena has no host buffer")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise IndexError(f"({offset}, {length}) outside arena of {self.size} bytes")
        if self.closed:
            raise ValueError(f"arena {self.arena_id} is closed")
        if self._whole is None:
            # Slicing one view is ten times cheaper than a ctypes view per
            # run (0.9 us each: half a millisecond per side of a tcp batch).
            whole = (ctypes.c_char * self.size).from_address(self.address)
            self._whole = memoryview(whole).cast("B")
        return self._whole[offset : offset + length]

    def close(self) -> None:
        """Releases the memory. Views of `tensor` must not be used afterwards."""
        if self.closed:
            return
        self.closed = True
        self._whole = None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._owns_mapping:
            unmap(self.address, self.size)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RemoteMapping:
    """A same-host peer's shared arena mapped into this process (fast path)."""

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < size:
                raise OSError(f"{path} is smaller than the published arena")
            self.address = map_shared(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self._tensor: torch.Tensor | None = None
        # Held by a copy on a thread other than the agent's loop, whose
        # `close` (a dropped peer) then waits for it rather than unmap under it.
        self.lock = threading.Lock()

    def tensor(self) -> torch.Tensor:
        """The mapping as one uint8 tensor (made once; not valid after `close`)."""
        if self._tensor is None:
            self._tensor = tensor_at(self.address, self.size)
        return self._tensor

    def close(self) -> None:
        with self.lock:
            self._tensor = None
            if self.size:
                unmap(self.address, self.size)
                self.size = 0


def copy_runs_reference(
    dst_base: int,
    src_base: int,
    triples,
    threads: int = 1,
    stream_min_bytes: int = 0,
    prefetch: bool = True,
) -> None:
    """memmove of uint64 (dst offset, src offset, length) rows, one ctypes call
    each: the reference of the compiled `kvrelay.transfer._runcopy.copy_runs`
    (same signature; `threads`, `stream_min_bytes` and `prefetch` change only
    its speed)."""
    move = ctypes.memmove
    for dst, src, length in np.asarray(triples, dtype=np.uint64).reshape(-1, 3).tolist():
        move(dst_base + dst, src_base + src, length)


def readv_runs_reference(
    pid: int, local_base: int, remote_base: int, triples, threads: int = 1, write: bool = False
) -> None:
    """pread (pwrite) of /proc/<pid>/mem per uint64 (local offset, remote
    offset, length) row: the reference of the compiled
    `kvrelay.transfer._runcopy.readv_runs` (same signature; `threads` changes
    only its speed), which has the kernel copy the runs with
    process_vm_readv (writev)."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDWR if write else os.O_RDONLY)
    try:
        for local, remote, length in np.asarray(triples, dtype=np.uint64).reshape(-1, 3).tolist():
            view = memoryview((ctypes.c_char * length).from_address(local_base + local)).cast("B")
            at = remote_base + remote
            while view:
                n = os.pwrite(fd, view, at) if write else os.preadv(fd, [view], at)
                if n <= 0:
                    raise OSError(f"/proc/{pid}/mem moved nothing at {at:#x}")
                view, at = view[n:], at + n
    finally:
        os.close(fd)


def owner_pid(shm_path: str) -> int | None:
    """The pid in a shared arena's `/proc/<pid>/fd/<fd>` path (None otherwise)."""
    parts = shm_path.split("/")
    if len(parts) == 5 and parts[:2] == ["", "proc"] and parts[3] == "fd" and parts[2].isdigit():
        return int(parts[2])
    return None


def _compiled(name: str, reference):
    try:
        from kvrelay.transfer import _runcopy
    except ImportError:  # built without it: same results, slower
        return reference
    if not hasattr(_runcopy, "readv_runs"):
        # A build from before readv_runs, whose copy_runs takes no `prefetch`
        # either: the references until it is rebuilt (setup.py build_ext).
        return reference
    return getattr(_runcopy, name)


copy_runs = _compiled("copy_runs", copy_runs_reference)
readv_runs = _compiled("readv_runs", readv_runs_reference)
