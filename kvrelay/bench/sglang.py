"""`kvrelay bench sglang`: pages/s and GB/s of kvrelay's SGLang HiCache backend
against SGLang's own `HiCacheFile`, on the same pages in one run.

Both are driven as SGLang's cache controller drives them, over real
`MHATokenToKVPoolHost` pools on CPU holding identical pages: kvrelay through
`batch_set_v1` / `batch_get_v1` (created by SGLang's `StorageBackendFactory`
with the dynamic config, against `kvrelay launch cache` processes), HiCacheFile
through its generic path (it has no v1 calls): `get_data_page` + `batch_set`,
`batch_get` into flat pages + `set_from_flat_data_page`. Each run writes fresh
keys (HiCacheFile skips a key already on disk); before each get the pool is
zeroed and after it every byte must equal what was set. HiCacheFile's files sit
in a temporary directory, so its gets are likely served from the page cache.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import ExitStack

import torch

from kvrelay.bench import sglang_mooncake as mooncake
from kvrelay.bench.stats import Summary, format_table, write_report
from kvrelay.cache import launch

ROWS = ("kvrelay set", "kvrelay get", "HiCacheFile set", "HiCacheFile get")
# Mooncake's settings by row name: whether a separate process holds the segment.
MOONCAKE_SETTINGS = {"Mooncake": False, "Mooncake-holder": True}
MODEL = "bench/sglang-hicache"


def _import_harness():
    try:
        from kvrelay.adapters.sglang import harness
    except ImportError as exc:
        raise SystemExit(
            f"kvrelay bench sglang: SGLang cannot be imported ({exc}); install it with "
            "`make sglang-deps` and run with PYTHONPATH=.venv-sglang"
        ) from None
    return harness


def _pool(h, args):
    pool = h.mha_pool(args.layout, heads=args.heads, layers=args.layers, start_layer=0,
                      page_size=args.page_size, head_dim=args.head_dim, dtype=torch.bfloat16,
                      device_tokens=args.pages * args.page_size)  # fmt: skip
    if pool.size < args.pages * args.page_size:
        raise SystemExit(f"kvrelay bench sglang: host pool of {pool.size} tokens is too small")
    return pool


class _Pages:
    """The pages of one pool: the bytes written, zeroing and the check after a get."""

    def __init__(self, pool, pages: int, seed: int = 0) -> None:
        self.pool, self.pages, self.checked = pool, pages, 0
        g = torch.Generator().manual_seed(seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g))
        self.truth = [self._page(i).clone() for i in range(pages)]

    def _page(self, i: int) -> torch.Tensor:
        return self.pool.get_data_page(i * self.pool.page_size).view(torch.uint8)

    def zero(self) -> None:
        self.pool.kv_buffer.view(torch.uint8).zero_()

    def check(self, who: str) -> None:
        """Every byte of every page as it was set (the pool was zeroed before the get)."""
        for i, want in enumerate(self.truth):
            if not torch.equal(self._page(i), want):
                wrong = int((self._page(i) != want).sum())
                raise RuntimeError(
                    f"kvrelay bench sglang: {who} get: page {i} has {wrong} wrong bytes"
                )
        self.checked += self.pages


def _batches(keys, page_size, batch):
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        yield chunk, torch.arange(i * page_size, (i + len(chunk)) * page_size, dtype=torch.int64)


def _kvrelay_set(backend, keys, args) -> None:
    for chunk, idx in _batches(keys, args.page_size, args.batch):
        if not all(backend.batch_set_v1(chunk, idx)):
            raise RuntimeError(
                f"kvrelay bench sglang: batch_set_v1 failed ({getattr(backend, 'stats', '')})"
            )


def _kvrelay_get(backend, keys, args) -> None:
    for chunk, idx in _batches(keys, args.page_size, args.batch):
        if not all(backend.batch_get_v1(chunk, idx)):
            raise RuntimeError(
                f"kvrelay bench sglang: batch_get_v1 missed ({getattr(backend, 'stats', '')})"
            )


def _file_set(backend, pool, keys, args) -> None:
    for chunk, idx in _batches(keys, args.page_size, args.batch):
        data = [pool.get_data_page(int(idx[i * args.page_size])) for i in range(len(chunk))]
        if not backend.batch_set(chunk, data):
            raise RuntimeError("kvrelay bench sglang: HiCacheFile batch_set failed")


def _file_get(backend, pool, keys, args) -> None:
    for chunk, idx in _batches(keys, args.page_size, args.batch):
        pages = backend.batch_get(chunk, [pool.get_dummy_flat_data_page() for _ in chunk])
        for i, page in enumerate(pages):
            if page is None:
                raise RuntimeError(f"kvrelay bench sglang: HiCacheFile missed {chunk[i]}")
            pool.set_from_flat_data_page(int(idx[i * args.page_size]), page)


def _timed(fn, *fn_args) -> float:
    start = time.perf_counter()
    fn(*fn_args)
    return time.perf_counter() - start


def _rates(times: list[float], pages: int, page_bytes: int) -> dict:
    return {
        "seconds": Summary.of(times).to_json(),
        "pages_per_s": Summary.of([pages / t for t in times]).to_json(),
        "gb_per_s": Summary.of([pages * page_bytes / t / 1e9 for t in times]).to_json(),
    }


def _peer(rows: dict, name: str, **facts) -> dict:
    """A store's entry in the issue-49 JSON: the median set and get rates."""
    out = dict(facts)
    for op in ("set", "get"):
        out[f"{op}_gbps"] = rows[f"{name} {op}"]["gb_per_s"]["median"]
        out[f"{op}_pages_per_s"] = rows[f"{name} {op}"]["pages_per_s"]["median"]
    return out


def _lane_counts(backend) -> dict:
    """How kvrelay's calls went: on SGLang's thread, and of those reads off
    the servers' slot boards (no lookup)."""
    stats = backend.get_stats().kvrelay
    return {"caller_calls": stats["caller_calls"], "board_reads": stats["board_reads"]}


def _measure_size(h, args, page_size: int, master) -> dict:
    """`args.runs` runs of set then get of `args.pages` pages of `page_size`
    tokens through every store, each on a pool of its own holding the same pages;
    the size's servers and files are gone before the next size starts."""
    args = argparse.Namespace(**{**vars(args), "page_size": page_size})
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        return _measure_stores(h, args, master, stack, tmp)


def _kvrelay_row(transport: str) -> str:
    """tcp keeps the rows' plain name ("kvrelay set"): the transport kvrelay defaults to."""
    return "kvrelay" if transport == "tcp" else f"kvrelay-{transport}"


def _kvrelay_store(h, args, transport: str, page_bytes: int, stack: ExitStack):
    """kvrelay's backend over `args.servers` cache servers speaking `transport`."""
    servers = []
    slots = args.pages * args.runs + 64
    for _ in range(args.servers):  # each holds every run's pages: the hash spreads unevenly
        server = launch.CacheServerProcess(token=h.TOKEN, page_bytes=page_bytes, pages=slots,
                                           backend=transport)  # fmt: skip
        stack.callback(server.stop)
        servers.append(server)
    identity = {"model_id": MODEL, "num_layers": args.layers, "num_kv_heads": args.heads}
    extra = h.dynamic_extra(servers, **identity) | {
        "timeout_s": args.timeout_s, "staging_pages": args.batch, "backend": transport}  # fmt: skip
    pool = _pool(h, args)
    pages = _Pages(pool, args.pages)
    config = h.storage_config(layout=args.layout, extra=extra, model_name=MODEL)
    backend = h.create_backend(config, pool)
    stack.callback(backend.close)
    _fill_arenas(h, backend, args, args.servers * slots)
    return backend, pages


def _fill_arenas(h, backend, args, slots: int) -> None:
    """Writes every server slot once, then drops the pages: memory never touched
    (the servers' arenas, and their mapping in this process) writes at a
    fraction of its later rate, which a deployed tier has long paid. The
    Mooncake segment gets the same treatment (`sglang_mooncake.fill_segment`)."""
    g = torch.Generator().manual_seed(12345)
    for start in range(0, slots, args.batch):
        n = min(args.batch, slots - start)
        tokens = torch.randint(0, 150_000, (n * args.page_size,), generator=g)
        keys = h.sglang_keys(tokens.tolist(), args.page_size)
        idx = torch.arange(n * args.page_size, dtype=torch.int64)
        backend.batch_set_v1(keys, idx)  # a full server refuses: that is fine here
    backend.clear()


def _mooncake_store(h, args, master, stack: ExitStack, page_bytes: int, holder: bool):
    """(Mooncake backend, its pages, its segment bytes, its master), or Nones
    without a master. `holder`: the segment is mounted by a process of its
    own, not by the rank, under a master of its own (one master places puts
    on every segment mounted on it: the settings must not share one)."""
    if master is None:
        return None, None, 0, None
    # One run's pages twice over: the bench removes them after each run.
    segment = max(mooncake.MIN_SEGMENT_BYTES, 2 * args.pages * page_bytes)
    if holder:
        master = mooncake.MasterProcess(timeout_s=args.timeout_s)
        stack.callback(master.stop)  # registered first: stopped after its clients
        stack.callback(mooncake.SegmentHolder(master, segment, args.timeout_s).stop)
    mc_pool = _pool(h, args)
    mc = mooncake.create_backend(master, mc_pool, layout=args.layout, model=MODEL,
                                 global_segment_bytes=0 if holder else segment)  # fmt: skip
    stack.callback(mooncake.close_backend, mc)
    mooncake.fill_segment(master, mc, mc_pool, segment)
    return mc, _Pages(mc_pool, args.pages), segment, master


def _mooncake_stores(h, args, master, stack: ExitStack, page_bytes: int) -> dict:
    """Mooncake as SGLang sets it up by default (the rank mounts the segment)
    and with a separate segment holder, by row name: each its own store, run
    in turn; none without a master."""
    stores = {}
    for name, holder in MOONCAKE_SETTINGS.items():
        mc, pages, segment, mc_master = _mooncake_store(h, args, master, stack, page_bytes, holder)
        if mc is not None:
            stores[name] = (mc, pages, segment, mc_master)
    return stores


def _measure_stores(h, args, master, stack: ExitStack, tmp: str) -> dict:
    page_bytes = 2 * args.layers * args.page_size * args.heads * args.head_dim * 2
    kvrelay = {t: _kvrelay_store(h, args, t, page_bytes, stack) for t in args.transport}
    file_pool = _pool(h, args)
    file_pages = _Pages(file_pool, args.pages)
    file_config = h.storage_config(layout=args.layout, model_name=MODEL,
                                   extra={"file_storage_path": tmp})  # fmt: skip
    hicache_file = h.HiCacheFile(file_config, file_path=tmp)
    seconds: dict[str, list[float]] = {
        f"{name} {op}": []
        for name in [*map(_kvrelay_row, args.transport), "HiCacheFile"]
        for op in ("set", "get")
    }
    stores = _mooncake_stores(h, args, master, stack, page_bytes)
    seconds |= {f"{name} {op}": [] for name in stores for op in ("set", "get")}
    for run in range(args.runs):
        g = torch.Generator().manual_seed(1 + run)
        tokens = torch.randint(0, 150_000, (args.pages * args.page_size,), generator=g)
        keys = h.sglang_keys(tokens.tolist(), args.page_size)
        for transport, (kv, kv_pages) in kvrelay.items():
            name = _kvrelay_row(transport)
            seconds[f"{name} set"].append(_timed(_kvrelay_set, kv, keys, args))
            kv_pages.zero()
            seconds[f"{name} get"].append(_timed(_kvrelay_get, kv, keys, args))
            kv_pages.check(name)
        seconds["HiCacheFile set"].append(_timed(_file_set, hicache_file, file_pool, keys, args))
        file_pages.zero()
        seconds["HiCacheFile get"].append(_timed(_file_get, hicache_file, file_pool, keys, args))
        file_pages.check("HiCacheFile")
        for name, (mc, mc_pages, _, mc_master) in stores.items():
            # SGLang's v1 calls, as its cache controller makes them (both zero-copy).
            seconds[f"{name} set"].append(_timed(_kvrelay_set, mc, keys, args))
            mc_pages.zero()
            seconds[f"{name} get"].append(_timed(_kvrelay_get, mc, keys, args))
            mc_pages.check(name)
            mc_master.empty(mc)  # untimed: the next run's pages fit the segment
    rows = {}
    for row, times in seconds.items():
        base = seconds["HiCacheFile " + row.split()[-1]]  # the same op's baseline
        ratios = Summary.of([b / t for b, t in zip(base, times, strict=True)]).to_json()
        rows[row] = _rates(times, args.pages, page_bytes) | {"x_hicache_file": ratios}
    transports = {t: _peer(rows, _kvrelay_row(t), transport=t, **_lane_counts(kvrelay[t][0]))
                  for t in args.transport}  # fmt: skip
    # kvrelay's entry is its best transport (the slower of set and get decides).
    best = max(transports.values(), key=lambda e: min(e["set_gbps"], e["get_gbps"]))
    checked = {f"{_kvrelay_row(t).replace('-', '_')}_pages": kvrelay[t][1].checked
               for t in args.transport}  # fmt: skip
    checked["hicache_file_pages"] = file_pages.checked
    entry = {"page_bytes": page_bytes, "page_size": args.page_size, "rows": rows,
             "kvrelay": best, "kvrelay_transports": transports,
             "file": _peer(rows, "HiCacheFile")}  # fmt: skip
    for name, (_, mc_pages, segment, _) in stores.items():
        field = name.lower().replace("-", "_")
        checked[f"{field}_pages"] = mc_pages.checked
        held = "holder process" if MOONCAKE_SETTINGS[name] else "rank"
        entry[field] = _peer(rows, name, protocol="tcp", global_segment_bytes=segment,
                             segment_in=held)  # fmt: skip
    entry["byte_check"] = checked
    return entry


def measure(args: argparse.Namespace) -> dict:
    """Every `--page-size`, every store, in one run, in one JSON document."""
    h = _import_harness()
    load_before = os.getloadavg()
    peers = {}
    with ExitStack() as stack:
        master = None
        why = mooncake.missing() if args.mooncake else "--no-mooncake"
        if why is None:
            master = mooncake.MasterProcess(timeout_s=args.timeout_s)
            stack.callback(master.stop)  # registered first: stopped after its clients close
            peers["mooncake"] = {"master": master.master_address, "protocol": "tcp",
                                 "metadata_server": master.metadata_server}  # fmt: skip
        else:
            peers["mooncake"] = {"skipped": why}
        sizes = [_measure_size(h, args, ps, master) for ps in args.page_size]
    return {
        "sizes": sizes,
        "peers": peers,
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=int, default=256, help="pages per run")
    parser.add_argument("--page-size", type=int, nargs="+", default=[16],
                        help="tokens per page; several: one table per page size")  # fmt: skip
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=64)
    layouts = ["layer_first", "page_first", "page_first_direct", "page_head"]
    parser.add_argument("--layout", default="page_first", choices=layouts)
    parser.add_argument("--batch", type=int, default=64, help="pages per backend call")
    parser.add_argument("--servers", type=int, default=1,
                        help="kvrelay cache server processes (one per host, as Mooncake's "
                             "default has one segment per rank)")  # fmt: skip
    parser.add_argument("--transport", nargs="+", default=["tcp"], choices=["tcp", "ucx"],
                        help="kvrelay's transfer backends, each its own rows; ucx: shared "
                        "memory on one host")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=60.0, help="kvrelay call bound")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--no-mooncake",
        dest="mooncake",
        action="store_false",
        help="leave Mooncake Store out (it runs where `make peers-deps` ran)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results here")


def _cell(s: dict, fmt: str) -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"


def run(args: argparse.Namespace) -> dict:
    sizes = (args.pages, *args.page_size, args.layers, args.heads, args.head_dim, args.batch,
             args.servers, args.runs)  # fmt: skip
    if min(sizes) < 1:
        raise SystemExit("kvrelay bench sglang: sizes, --batch, --servers and --runs must be >= 1")
    result = measure(args)
    skipped = result["peers"]["mooncake"].get("skipped")
    if skipped:
        print(f"kvrelay bench sglang: Mooncake Store left out: {skipped}")
    load = result["load_average"]
    for size in result["sizes"]:
        table = [[row, _cell(r["pages_per_s"], ".0f"), _cell(r["gb_per_s"], ".3f"),
                  _cell(r["x_hicache_file"], ".2f")]
                 for row, r in size["rows"].items()]  # fmt: skip
        print(f"{args.pages} pages of {size['page_bytes']} B ({size['page_size']} tokens, "
              f"{args.layout}, {args.batch} per call), {args.runs} runs, {args.servers} "
              f"cache servers (load average {load['before'][0]:.1f} before, "
              f"{load['after'][0]:.1f} after)")  # fmt: skip
        print(format_table(["", "pages/s", "GB/s", "x HiCacheFile"], table))
    write_report(args, "sglang", result)
    sys.stdout.flush()
    return result
