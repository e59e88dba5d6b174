"""The `file` L3 store: one file per page in a directory (the embedded default).

Writes go to a temporary file in the same directory and are renamed into
place, so a reader (or a restarted server) sees a whole page or none. The
store keeps its own byte capacity with LRU eviction; the LRU order lives in
memory and in file mtimes (touched on every hit), so a restart rebuilds it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

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


class FileStore(L3Store):
    name = "file"

    def __init__(self, config: FileStoreConfig) -> None:
        super().__init__()
        if config.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {config.capacity_bytes}")
        self.config = config
        self.root = Path(config.directory)
        self._tmp = self.root / _TMP_DIR
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # key -> file size, least recently used first.
        self._files: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._scan()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: bytes) -> bool:
        return key in self._files

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        # Two hex digits of fan-out keep directories small.
        return self.root / name[:2] / (name + _SUFFIX)

    def _scan(self) -> None:
        """Rebuild the LRU from the directory; drop temporaries of interrupted writes."""
        for leftover in self._tmp.iterdir():
            leftover.unlink(missing_ok=True)
        found = []
        for path in self.root.glob(f"??/*{_SUFFIX}"):
            try:
                key = bytes.fromhex(path.name[: -len(_SUFFIX)])
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if len(key) == record.KEY_BYTES:
                found.append((stat.st_mtime_ns, key, stat.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self._bytes += size
        self._make_room(0)

    def put(self, key: bytes, page: bytes | memoryview) -> bool:
        check_key(key)
        size = record.HEADER_BYTES + len(page)
        if size > self.config.capacity_bytes:
            return False
        header = record.encode_header(key, page)
        path = self._path(key)
        tmp = self._tmp / f"{key.hex()}.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(page)
                if self.config.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            path.parent.mkdir(exist_ok=True)
            with self._lock:
                os.replace(tmp, path)
                self._bytes -= self._files.pop(key, 0)
                self._files[key] = size
                self._bytes += size
                self._make_room(0)
        except OSError:
            tmp.unlink(missing_ok=True)
            self.stats.errors += 1
            return False
        self.stats.puts += 1
        self.stats.bytes_in += len(page)
        return True

    def get(self, key: bytes) -> bytes | None:
        check_key(key)
        self.stats.gets += 1
        with self._lock:
            if key not in self._files:
                return None
            self._files.move_to_end(key)
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError:
            self.stats.errors += 1
            return None
        page = record.decode(key, blob)
        if page is None:
            self.stats.checksum_failures += 1
            self.delete(key)
            return None
        try:
            now = time.time_ns()
            os.utime(path, ns=(now, now))
        except OSError:
            pass  # only the LRU order after a restart is lost
        self.stats.hits += 1
        self.stats.bytes_out += len(page)
        return bytes(page)

    def delete(self, key: bytes) -> bool:
        check_key(key)
        present = self._forget(key)
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError:
            self.stats.errors += 1
        return present

    def _forget(self, key: bytes) -> bool:
        with self._lock:
            size = self._files.pop(key, None)
            if size is None:
                return False
            self._bytes -= size
            return True

    def _make_room(self, incoming: int) -> None:
        """Evict least recently used files until `incoming` more bytes fit (lock held)."""
        while self._files and self._bytes + incoming > self.config.capacity_bytes:
            key, size = self._files.popitem(last=False)
            self._bytes -= size
            self._path(key).unlink(missing_ok=True)
            self.stats.evictions += 1
