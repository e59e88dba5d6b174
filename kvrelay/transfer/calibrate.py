"""How the same-host fast path copies, chosen by what this host measures.

The copy that was fastest where the fast path was tuned (non-temporal
stores with a `prefetchnta` ahead, one thread per 64 MiB, a mapped 4 KiB-page
memfd) lost to the kernel's own copy on another VM of the same kind. So an
agent measures the candidates once, on the shapes a pull has, and keeps the
fastest: a short calibration (about half a second on an idle 2-core VM,
several under load) cached per boot in
`~/.cache/kvrelay` (`$XDG_CACHE_HOME`), behind a file lock so that agents
starting together measure once. `kvrelay info` and `kvrelay bench transfer`
report it.

Candidates, each on a batch of 64 KiB runs scattered over a memfd larger
than the last-level cache and on one contiguous run, from a cold cache:
  map    copy out of the peer's memfd mapped here (`_runcopy.copy_runs`):
         plain or non-temporal stores, with or without prefetch, 1 or 2 threads
  readv  the kernel copies the runs out of the peer (`process_vm_readv`, up
         to 1024 runs a call; `_runcopy.readv_runs`): 1 or 2 threads
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CALIBRATION_VERSION = 2  # 2: two threads must win by TWO_THREAD_MARGIN
CONTIGUOUS_RUN_BYTES = 1 << 20  # a batch whose runs average this much is "contiguous"
_SHAPE_BYTES = 8 << 20  # bytes per measured copy
_RUN_BYTES = 64 << 10
_ROUNDS = 3
TWO_THREAD_MARGIN = 1.15
# Striped pulls need less: a split where two kernel copies gain nothing
# moves about what one worker moves (both halves at once, each at half
# speed: 11-14 GB/s against one worker's 13 on the one-run batch), while a
# pull left whole where they gain gives up 1.3-1.6x. Calibrations of one
# quiet host measured 1.13-1.68x per shape.
STRIPE_MARGIN = 1.05


@dataclass(frozen=True, slots=True)
class CopyChoice:
    """One way to copy a batch of runs between two processes of this host."""

    method: str  # "map" (copy from the mapped memfd) or "readv" (process_vm_readv)
    threads: int = 1
    stream: bool = False  # map: non-temporal stores
    prefetch: bool = False  # map with stream: prefetchnta 1 KiB ahead

    @property
    def label(self) -> str:
        if self.method == "readv":
            return f"readv, {self.threads} thread{'s' * (self.threads > 1)}"
        stores = "stream" + (" + prefetch" if self.prefetch else "") if self.stream else "plain"
        return f"map, {stores}, {self.threads} thread{'s' * (self.threads > 1)}"


DEFAULT_CHOICE = CopyChoice("map", 1, stream=False)


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """The chosen copy per shape of batch, with what was measured (GB/s by label)."""

    scattered: CopyChoice
    contiguous: CopyChoice
    measured: dict  # shape -> {label: GB/s, fastest of the rounds}
    host: dict
    seconds: float = 0.0  # how long the calibration took
    source: str = "measured"  # "measured", "cache" or "default"

    def choose(self, nbytes: int, rows: int) -> CopyChoice:
        big = rows == 0 or nbytes // rows >= CONTIGUOUS_RUN_BYTES
        return self.contiguous if big else self.scattered

    def kernel_copy_ratios(self) -> dict[str, float]:
        """Per shape measured: two threads of `process_vm_readv` (the
        kernel's copy, what UCX's cma does) over one; {} when a shape lacks
        either."""
        ratios = {}
        for shape, rates in self.measured.items():
            one, two = rates.get("readv, 1 thread"), rates.get("readv, 2 threads")
            if not one or not two:
                return {}
            ratios[shape] = two / one
        return ratios

    def kernel_copy_threads(self) -> int:
        """2 when two kernel copies beat one by STRIPE_MARGIN on average
        over the shapes measured; else 1 (also when nothing was measured).
        On average, not on each: one short calibration after other work
        once measured 1.29x scattered and 1.15x contiguous on a host where
        two threads otherwise measured 1.45-1.69x on both."""
        ratios = list(self.kernel_copy_ratios().values())
        return 2 if ratios and sum(ratios) / len(ratios) > STRIPE_MARGIN else 1

    def to_json(self) -> dict:
        return {
            "scattered": asdict(self.scattered) | {"label": self.scattered.label},
            "contiguous": asdict(self.contiguous) | {"label": self.contiguous.label},
            "measured_gb_per_s": self.measured,
            "host": self.host,
            "seconds": round(self.seconds, 3),
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict, source: str) -> CopyPlan:
        def choice(d: dict) -> CopyChoice:
            stream, prefetch = bool(d["stream"]), bool(d["prefetch"])
            return CopyChoice(d["method"], int(d["threads"]), stream, prefetch)

        return cls(
            choice(data["scattered"]),
            choice(data["contiguous"]),
            data["measured_gb_per_s"],
            data["host"],
            float(data.get("seconds", 0.0)),
            source,
        )


def _read(path: str, default: str = "") -> str:
    with contextlib.suppress(OSError):
        return Path(path).read_text(encoding="ascii", errors="replace").strip()
    return default


def _bracketed(text: str) -> str:
    """The selected value of a sysfs choice list ("always [madvise] never")."""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text


def _cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def host_facts() -> dict:
    """What the fast path's speed depends on: kernel, huge pages, cpu."""
    thp = "/sys/kernel/mm/transparent_hugepage/"
    return {
        "kernel": platform.release(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "thp_enabled": _bracketed(_read(thp + "enabled", "absent")),
        "thp_shmem_enabled": _bracketed(_read(thp + "shmem_enabled", "absent")),
        "hugetlb_pages": int(_read("/proc/sys/vm/nr_hugepages", "0") or 0),
        "llc_bytes": llc_bytes(),
    }


def host_warnings(facts: dict) -> list[str]:
    """What the host lacks that the fast path would use."""
    out = []
    if facts["thp_shmem_enabled"] not in ("always", "advise", "within_size", "force"):
        out.append(
            f"shared memory huge pages are off (shmem_enabled = {facts['thp_shmem_enabled']}): "
            "shared arenas use 4 KiB pages, so copies of scattered runs out of them miss the TLB "
            "per 4 KiB"
        )
    if facts["thp_enabled"] not in ("always", "madvise"):
        out.append(
            f"transparent huge pages are off (enabled = {facts['thp_enabled']}): private arenas "
            "use 4 KiB pages too"
        )
    return out


def llc_bytes() -> int:
    text = _read("/sys/devices/system/cpu/cpu0/cache/index3/size", "32M")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        return int(text.rstrip("KMG")) * units.get(text[-1], 1)
    except ValueError:
        return 32 << 20


def candidates(cpus: int) -> list[CopyChoice]:
    out = [
        CopyChoice("map", 1),
        CopyChoice("map", 1, stream=True, prefetch=True),
        CopyChoice("map", 1, stream=True),
        CopyChoice("readv", 1),
    ]
    if cpus > 1:
        out += [
            CopyChoice("map", 2),
            CopyChoice("map", 2, stream=True, prefetch=True),
            CopyChoice("readv", 2),
        ]
    return out


def run_copy(choice: CopyChoice, pid: int, dst: int, src: int, rows, nbytes: int) -> None:
    """Copies rows (dst offset, src offset, length) as `choice` says; `src` is
    the source's address in this process (map) or in `pid` (readv)."""
    from kvrelay.transfer.arena import copy_runs, readv_runs

    if choice.method == "readv":
        readv_runs(pid, dst, src, rows, choice.threads, False)
        return
    stream_min = 0 if choice.stream else 1 << 63
    copy_runs(dst, src, rows, choice.threads, stream_min, choice.prefetch)


def measure(rounds: int = _ROUNDS) -> CopyPlan:
    """Times every candidate on both shapes, interleaved, from a cold cache."""
    import torch

    from kvrelay.transfer.arena import Arena, private_tensor

    started = time.perf_counter()
    facts = host_facts()
    source = Arena.allocate_shared(0, max(128 << 20, 4 * facts["llc_bytes"]))
    try:
        source.tensor.fill_(1)
        dst = private_tensor(_SHAPE_BYTES)
        dst.fill_(0)
        # Writing 1.5 x the last-level cache before each copy evicts its source
        # and destination (what a pull meets after other work).
        sweep = torch.zeros(max(48 << 20, 3 * facts["llc_bytes"] // 2), dtype=torch.uint8)
        count = _SHAPE_BYTES // _RUN_BYTES
        slots = random.Random(0).sample(range(source.size // _RUN_BYTES), count)
        scattered = np.zeros((count, 3), dtype=np.uint64)
        scattered[:, 0] = np.arange(count, dtype=np.uint64) * _RUN_BYTES
        scattered[:, 1] = np.asarray(slots, dtype=np.uint64) * _RUN_BYTES
        scattered[:, 2] = _RUN_BYTES
        contiguous = np.asarray([[0, source.size - _SHAPE_BYTES, _SHAPE_BYTES]], dtype=np.uint64)
        shapes = {"scattered": scattered, "contiguous": contiguous}
        choices = candidates(facts["cpus"] or 1)
        times = {(s, c): [] for s in shapes for c in choices}
        pid = os.getpid()
        for _ in range(rounds + 1):  # the first round warms code and page tables
            for (shape, choice), out in times.items():
                sweep.add_(1)
                start = time.perf_counter()
                run_copy(choice, pid, dst.data_ptr(), source.address, shapes[shape], _SHAPE_BYTES)
                out.append(time.perf_counter() - start)
        measured = {s: {} for s in shapes}
        for (shape, choice), out in times.items():
            # The fastest round: other processes only ever slow a copy down,
            # and on a shared host a median still carried their bursts.
            measured[shape][choice.label] = round(_SHAPE_BYTES / min(out[1:]) / 1e9, 3)
    finally:
        source.close()
    elapsed = time.perf_counter() - started
    best = {shape: pick(choices, measured[shape]) for shape in shapes}
    return CopyPlan(best["scattered"], best["contiguous"], measured, facts, elapsed)


def pick(choices: list[CopyChoice], rates: dict[str, float]) -> CopyChoice:
    """The fastest one-thread choice, or a two-thread one that beats it by
    `TWO_THREAD_MARGIN`: a second thread only pays on an idle core, and in a
    pull it competes with the owner and the reader's own loop (on this 2-core
    host two-thread candidates won by under 1% or lost by up to 10x, by the
    load of the moment)."""
    single = max((c for c in choices if c.threads == 1), key=lambda c: rates[c.label])
    multi = [c for c in choices if c.threads > 1]
    if multi:
        best = max(multi, key=lambda c: rates[c.label])
        if rates[best.label] > TWO_THREAD_MARGIN * rates[single.label]:
            return best
    return single


def _boot_id() -> str:
    return _read("/proc/sys/kernel/random/boot_id", "unknown")


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = json.dumps([CALIBRATION_VERSION, _boot_id(), host_facts()], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(base) / "kvrelay" / f"copy-plan-{digest}.json"


def calibrate(*, fresh: bool = False) -> CopyPlan:
    """The cached plan of this boot and host, measured (and cached) when
    there is none or `fresh`. Falls back to measuring without a cache when
    the cache directory is not writable."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a+")  # noqa: SIM115 (held across the measurement)
    except OSError:
        return measure()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # agents starting together measure once
        if not fresh:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                return CopyPlan.from_json(json.loads(path.read_text(encoding="utf-8")), "cache")
        plan = measure()
        with contextlib.suppress(OSError):
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(plan.to_json(), indent=2), encoding="utf-8")
            tmp.replace(path)
        return plan


@functools.cache
def copy_plan() -> CopyPlan:
    """This process's plan (calibrated once per boot, see `calibrate`)."""
    return calibrate()


FAST_COPIES = ("calibrated", "map", "readv")


def fast_copy_plan(fast_copy: str) -> CopyPlan:
    """An agent's plan for its `fast_copy` setting: calibrated, or one forced
    choice for every batch (plain stores out of the mapping, or readv)."""
    if fast_copy == "calibrated":
        return copy_plan()
    if fast_copy not in FAST_COPIES:
        raise ValueError(f"fast_copy must be one of {FAST_COPIES}, not {fast_copy!r}")
    choice = DEFAULT_CHOICE if fast_copy == "map" else CopyChoice("readv", 1)
    return CopyPlan(choice, choice, {}, {}, 0.0, f"forced {fast_copy}")
