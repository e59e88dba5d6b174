"""The `file` L3 store: one file per page in a directory (the embedded default).

Writes go to a temporary file in the same directory and are renamed into
place, so a reader (or a restarted server) sees a whole page or none. The
store keeps its own byte capacity, evicting in the order of an
`EvictionPolicy` (`kvrelay.cache.eviction`; LRU by default: a store gets
no chain parents, and its reads are promotions, each of which moves the
page up to L2). The order lives in memory and in file mtimes (touched on
every hit), so a restart rebuilds it, reads in mtime order.

Layout: `DIR/<namespace hex>/<2 hex of key>/<key hex>.page`, so flushing one
tenant removes one directory's files and leaves the others alone.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvrelay.cache.eviction import make_policy
from kvrelay.cache.l3 import record
from kvrelay.cache.l3.base import L3Store, check_key

_SUFFIX = ".page"
_TMP_DIR = "tmp"


@dataclass(frozen=True, slots=True)
class FileStoreConfig:
    directory: Path
    capacity_bytes: int
    # fsync before the rename: pages then survive a machine crash, not just a
    # process restart, at the price of a disk flush per page.
    fsync: bool = False
    # Which file goes first at the byte cap (kvrelay.cache.eviction.POLICIES).
    eviction: str = "lru"


class FileStore(L3Store):
    name = "file"

    def __init__(self, config: FileStoreConfig) -> None:
        super().__init__()
        if config.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {config.capacity_bytes}")
        self.config = config
        self.root = Path(config.directory)
        self._root = str(self.root)
        self._tmp = self.root / _TMP_DIR
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # (namespace, key) -> file size; the policy orders the same names.
        self._files: dict[tuple[bytes, bytes], int] = {}
        self._policy = make_policy(config.eviction)
        self._bytes = 0
        self._scan()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: bytes) -> bool:
        """Whether `key` is stored, in any namespace."""
        return any(k == key for _, k in self._files)

    def _path(self, key: bytes, namespace: bytes = b"") -> Path:
        return Path(self._file(key, namespace))

    def _file(self, key: bytes, namespace: bytes) -> str:
        # Strings, not Paths: this runs for every page moved.
        name = key.hex()
        # Two hex digits of fan-out keep directories small.
        return (
            f"{self._root}/{record.normalize_namespace(namespace).hex()}/{name[:2]}/{name}{_SUFFIX}"
        )

    def _scan(self) -> None:
        """Rebuild the LRU from the directory; drop temporaries of interrupted writes."""
        for leftover in self._tmp.iterdir():
            leftover.unlink(missing_ok=True)
        found = []
        for path in self.root.glob(f"*/??/*{_SUFFIX}"):
            try:
                namespace = bytes.fromhex(path.parent.parent.name)
                key = bytes.fromhex(path.name[: -len(_SUFFIX)])
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if len(key) == record.KEY_BYTES and len(namespace) == record.NAMESPACE_BYTES:
                found.append((stat.st_mtime_ns, namespace, key, stat.st_size))
        for _, namespace, key, size in sorted(found):
            self._add(namespace, key, size)
        self._make_room(0)

    def put(self, key: bytes, page: bytes | memoryview, namespace: bytes = b"") -> bool:
        check_key(key)
        ns = record.normalize_namespace(namespace)
        size = record.HEADER_BYTES + len(page)
        if size > self.config.capacity_bytes:
            return False
        header = record.encode_header(key, page, ns)
        path = self._file(key, ns)
        tmp = f"{self._tmp}/{key.hex()}.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(page)
                if self.config.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            with self._lock:
                try:
                    os.replace(tmp, path)
                except FileNotFoundError:  # the page's first directory
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    os.replace(tmp, path)
                self._drop(ns, key)
                self._add(ns, key, size)
                self._make_room(0)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self.stats.errors += 1
            return False
        self.stats.puts += 1
        self.stats.bytes_in += len(page)
        return True

    def get(self, key: bytes, namespace: bytes = b"") -> bytes | None:
        check_key(key)
        ns = record.normalize_namespace(namespace)
        self.stats.gets += 1
        with self._lock:
            if (ns, key) not in self._files:
                return None
            self._policy.touch((ns, key))
        path = self._file(key, ns)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            self._forget(ns, key)
            return None
        except OSError:
            self.stats.errors += 1
            return None
        page = record.decode(key, blob, ns)
        if page is None:
            self.stats.checksum_failures += 1
            self.delete(key, ns)
            return None
        try:
            now = time.time_ns()
            os.utime(path, ns=(now, now))
        except OSError:
            pass  # only the LRU order after a restart is lost
        self.stats.hits += 1
        self.stats.bytes_out += len(page)
        return bytes(page)

    def delete(self, key: bytes, namespace: bytes = b"") -> bool:
        check_key(key)
        ns = record.normalize_namespace(namespace)
        present = self._forget(ns, key)
        try:
            os.unlink(self._file(key, ns))
        except FileNotFoundError:
            pass
        except OSError:
            self.stats.errors += 1
        return present

    def flush(self, namespace: bytes | None = None) -> int:
        """Remove the namespace's files, those this store knows and any others in its
        directory (left by another process sharing it); return how many."""
        ns = None if namespace is None else record.normalize_namespace(namespace)
        with self._lock:
            chosen = [name for name in self._files if ns is None or name[0] == ns]
            for name in chosen:
                self._drop(*name)
        removed = 0
        pattern = f"{'*' if ns is None else ns.hex()}/??/*{_SUFFIX}"
        for path in self.root.glob(pattern):
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                self.stats.errors += 1
        return removed

    def _forget(self, namespace: bytes, key: bytes) -> bool:
        with self._lock:
            return self._drop(namespace, key)

    def _add(self, namespace: bytes, key: bytes, size: int) -> None:
        """Count a stored file and hand it to the policy, evictable at once (lock held)."""
        self._files[namespace, key] = size
        self._bytes += size
        self._policy.admit((namespace, key), None, True)

    def _drop(self, namespace: bytes, key: bytes) -> bool:
        size = self._files.pop((namespace, key), None)
        if size is None:
            return False
        self._bytes -= size
        self._policy.forget((namespace, key))
        return True

    def _make_room(self, incoming: int) -> None:
        """Evict files in the policy's order until `incoming` more bytes fit (lock held)."""
        while self._files and self._bytes + incoming > self.config.capacity_bytes:
            namespace, key = self._policy.victim()
            self._bytes -= self._files.pop((namespace, key))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file(key, namespace))
            self.stats.evictions += 1
