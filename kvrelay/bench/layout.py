"""`kvrelay bench layout`: gather/scatter throughput against memcpy.

A realistic request (default 8K tokens of a 32-layer, 8-KV-head, head-dim-128
bf16 model) sits in an engine pool of 16-token pages, shuffled as a busy pool
is. Each run times, back to back on the same buffers: `Tensor.copy_` of the
same number of bytes (the baseline), gather_pages (pool -> unified pages) and
scatter_pages (unified pages -> pool). The ratio op/memcpy is taken per run,
so slow phases of a noisy machine hit both sides, then summarised. With
`--device cuda` everything lives on the GPU: the CUDA kernel against a
device-to-device `copy_` of the same bytes, each timed to stream completion.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from kvrelay.bench.stats import Summary, format_table, machine_info, time_once, write_json
from kvrelay.cuda_ext import (
    gather_pages,
    rect_geometry,
    scatter_pages,
    slot_mapping_from_block_table,
)
from kvrelay.layout import DEFAULT_PAGE_SIZE, ModelKVSpec, ParallelConfig, rank_rectangle
from kvrelay.model.device import DeviceError, parse_device, synchronize

TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "uint8": torch.uint8,
}


@dataclass(slots=True)
class Workload:
    """An engine pool holding one request, and the unified pages it maps to."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    pages: torch.Tensor
    page_ids: torch.Tensor
    slots: torch.Tensor
    geometry: dict[str, int]
    bytes_moved: int
    flat_src: torch.Tensor  # memcpy baseline source: as many bytes as the op moves
    flat_dst: torch.Tensor  # memcpy baseline destination: the page arena


def build_workload(
    spec: ModelKVSpec,
    parallel: ParallelConfig,
    tokens: int,
    engine_page: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Workload:
    """On `device`: the pool, the page arena and the copy baseline's buffers."""
    rect = rank_rectangle(spec, parallel)
    dtype = TORCH_DTYPES[spec.kv_dtype]
    gen = torch.Generator().manual_seed(seed)
    engine_pages = -(-tokens // engine_page)
    num_slots = engine_pages * engine_page
    # vLLM-style per-layer tensor [2, slots, heads, dim]: K and V are its halves.
    kv = [
        torch.empty(2, num_slots, rect.num_heads, spec.k_head_dim, dtype=dtype, device=device)
        for _ in range(rect.num_layers)
    ]
    for i, t in enumerate(kv):
        # Written, not left as untouched zero pages the kernel would map lazily.
        t.view(torch.uint8).fill_(i % 251 + 1)
    slots = slot_mapping_from_block_table(
        torch.randperm(engine_pages, generator=gen), engine_page, tokens, spec.page_size
    )
    slots = slots.to(device)
    num_pages = slots.size(0)
    pages = torch.zeros(num_pages, spec.page_bytes, dtype=torch.uint8, device=device)
    moved = num_pages * rect.num_bytes(spec)
    return Workload(
        k=[t[0] for t in kv],
        v=[t[1] for t in kv],
        pages=pages,
        page_ids=torch.arange(num_pages, device=device),
        slots=slots,
        geometry=rect_geometry(spec, rect),
        bytes_moved=moved,
        flat_src=torch.ones(moved, dtype=torch.uint8, device=device),
        flat_dst=pages.view(-1)[:moved],
    )


def measure(work: Workload, runs: int, threads: int) -> dict[str, Summary]:
    """Interleaved timings of memcpy, gather and scatter on `threads` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        args = (work.k, work.v, work.pages, work.page_ids, work.slots)

        def memcpy():
            work.flat_dst.copy_(work.flat_src)

        def gather():
            gather_pages(*args, **work.geometry)

        def scatter():
            scatter_pages(*args, **work.geometry)

        device = work.pages.device

        def timed(fn) -> float:
            # A GPU op is timed to its completion: launch, then wait for the stream.
            return time_once(lambda: (fn(), synchronize(device)))

        for fn in (memcpy, gather, scatter):  # warm up: page faults, numba compile
            timed(fn)
        times: dict[str, list[float]] = {"memcpy": [], "gather": [], "scatter": []}
        for _ in range(runs):
            for name, fn in (("memcpy", memcpy), ("gather", gather), ("scatter", scatter)):
                times[name].append(timed(fn))
    finally:
        torch.set_num_threads(previous)
    out = {name: Summary.of(values) for name, values in times.items()}
    for op in ("gather", "scatter"):
        ratios = [m / t for m, t in zip(times["memcpy"], times[op], strict=True)]
        out[f"{op}_vs_memcpy"] = Summary.of(ratios)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="bfloat16")
    parser.add_argument(
        "--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="unified page, tokens"
    )
    parser.add_argument("--engine-page-size", type=int, default=16)
    parser.add_argument("--tp", type=int, default=4, help="TP degree of the partial case")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", default=None,
                        help="CPU thread counts, comma-separated (default 1,2)")  # fmt: skip
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda[:N]: the CUDA kernel vs a device copy_")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the results here")


def run(args: argparse.Namespace) -> dict:
    if args.runs < 1 or args.tokens < 1:
        raise SystemExit("--runs and --tokens must be positive")
    try:
        device = parse_device(args.device)
    except DeviceError as exc:
        raise SystemExit(f"kvrelay bench layout: {exc}") from None
    if device.type == "cuda" and args.threads is not None:
        raise SystemExit("kvrelay bench layout: --threads applies to the CPU op only")
    threads = [int(t) for t in str(args.threads or "1,2").split(",") if t]
    if device.type == "cuda":
        threads = [1]  # one launch per call; the row's thread count is the host's
    spec = ModelKVSpec(model_id="bench", weights_fingerprint="", num_layers=args.layers,
                       num_kv_heads=args.kv_heads, k_head_dim=args.head_dim,
                       v_head_dim=args.head_dim, kv_dtype=args.dtype,
                       page_size=args.page_size)  # fmt: skip
    cases = [("full (TP=1)", ParallelConfig())]
    if args.tp > 1:
        cases.append((f"TP={args.tp} rank 0", ParallelConfig(tp=args.tp)))
    results, rows = [], []
    for name, parallel in cases:
        work = build_workload(spec, parallel, args.tokens, args.engine_page_size, device=device)
        for n in threads:
            m = measure(work, args.runs, n)
            results.append(
                {
                    "case": name,
                    "threads": n,
                    "bytes": work.bytes_moved,
                    **{k: v.to_json() for k, v in m.items()},
                }
            )
            rows.append(_row(name, n, work.bytes_moved, m))
        del work
    headers = ["case", "thr", "MiB", "memcpy GB/s", "gather GB/s", "x memcpy",
               "scatter GB/s", "x memcpy"]  # fmt: skip
    print(format_table(headers, rows))
    baseline = "device-to-device copy_" if device.type == "cuda" else "memcpy (copy_)"
    print(f"on {device}; memcpy = {baseline} of the same bytes in the same run")
    print("GB/s and ratios: median of runs [min-max]; ratio = memcpy time / op time per run")
    payload = {
        "benchmark": "layout",
        "config": {k: v for k, v in vars(args).items() if not callable(v)}
        | {"threads": threads, "device": str(device)},
        "machine": machine_info(),
        "results": results,
    }
    if args.json:
        write_json(args.json, payload)
    return payload


def _row(name: str, threads: int, nbytes: int, m: dict[str, Summary]) -> list[str]:
    def rate(s: Summary) -> str:
        return f"{nbytes / s.median / 1e9:.2f}"

    def ratio(s: Summary) -> str:
        return f"{s.median:.2f} [{s.min:.2f}-{s.max:.2f}]"

    return [
        name,
        str(threads),
        f"{nbytes / 2**20:.0f}",
        rate(m["memcpy"]),
        rate(m["gather"]),
        ratio(m["gather_vs_memcpy"]),
        rate(m["scatter"]),
        ratio(m["scatter_vs_memcpy"]),
    ]
