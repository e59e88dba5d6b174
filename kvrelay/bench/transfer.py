"""`kvrelay bench transfer`: page pulls between two processes on this host.

A publishing agent in a spawned process owns an arena (default 1 GiB) and
publishes single runs (1, 16, 256 MiB) and a batch of 512 random 64 KiB
runs. This process pulls each of them `--runs` times per mode: ucx over
shm/cma, ucx over tcp (UCX_TLS), the tcp backend and the same-host fast path.
Baselines measured in the same run: memcpy (`Tensor.copy_`) of the same byte
count, `ucx_perftest` from the UCX wheel (`ucp_get`, `-O 512` for the batch),
and for the tcp backend a plain loopback TCP stream of the same bytes.
When NIXL is installed, its UCX READ of the same cases (`nixl_peer`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import multiprocessing
import os
import random
import re
import socket
import subprocess
import time
from pathlib import Path

import msgpack
import torch

from kvrelay.bench import nixl_peer, transfer_host
from kvrelay.bench.stats import Summary, format_table, machine_info, time_once, write_json
from kvrelay.bench.tcp_stream import tcp_stream

TOKEN = "kvrelay-bench"
NAMESPACE = hashlib.sha256(b"kvrelay bench transfer").digest()
MODES = {  # name: (backend, UCX_TLS, fast path)
    "ucx (shm/cma)": ("ucx", "sm,self", False),
    "ucx (tcp)": ("ucx", "tcp,self", False),
    "tcp": ("tcp", None, False),
    "fast path": ("ucx", None, True),
}


def _cases(arena: int, sizes_mib: list[int], batch: int, run_kib: int) -> list[tuple]:
    cases = [(f"single {s} MiB", [(0, s << 20)]) for s in sizes_mib if s << 20 <= arena]
    slots = random.Random(0).sample(range(arena // (run_kib << 10)), batch)
    cases.append(
        (f"batch {batch} x {run_kib} KiB", [(s * (run_kib << 10), run_kib << 10) for s in slots])
    )
    # ucx_perftest's access pattern: the same run read `batch` times into the
    # same place (both stay in the cache), to tell the cost of random runs of
    # a large arena from the cost of the path.
    cases.append((f"batch {batch} x {run_kib} KiB, one run", [(0, run_kib << 10)] * batch))
    return cases


def local_offsets(run_list) -> list[int]:
    """Where a case's runs land in the reader's arena: one after another, or
    all at 0 when the case reads one run again and again (as ucx_perftest
    does)."""
    if len(run_list) > 1 and len(set(run_list)) == 1:
        return [0] * len(run_list)
    offsets, at = [], 0
    for _, n in run_list:
        offsets.append(at)
        at += n
    return offsets


def _owner(pipe, backend, tls, fast, arena_bytes, runs_list) -> None:
    if tls:
        os.environ["UCX_TLS"] = tls
    asyncio.run(_own(pipe, backend, fast, arena_bytes, runs_list))


async def _own(pipe, backend, fast, arena_bytes, runs_list) -> None:
    from kvrelay.transfer import create_agent

    agent = await create_agent(backend, token=TOKEN, fast_path=fast, lease_seconds=3600)
    arena = agent.allocate_arena(arena_bytes)
    arena.tensor.fill_(1)  # touch every page
    handles = [agent.publish(arena, runs, NAMESPACE).to_bytes() for runs in runs_list]
    pipe.send_bytes(msgpack.packb(handles))
    await asyncio.get_running_loop().run_in_executor(None, pipe.recv_bytes)
    await agent.close()


async def _pull(mode: str, cases, arena_bytes: int, runs: int, timeout: float) -> dict:
    from kvrelay.transfer import create_agent

    backend, tls, fast = MODES[mode]
    if tls:
        os.environ["UCX_TLS"] = tls
    else:
        os.environ.pop("UCX_TLS", None)
    ctx = multiprocessing.get_context("spawn")
    pipe, child = ctx.Pipe()
    args = (child, backend, tls, fast, arena_bytes, [r for _, r in cases])
    owner = ctx.Process(target=_owner, args=args, daemon=True)
    owner.start()
    out = {}
    try:
        if not pipe.poll(120):
            raise RuntimeError("the owner process did not start")
        handles = msgpack.unpackb(pipe.recv_bytes())
        agent = await create_agent(backend, token=TOKEN, fast_path=fast)
        largest = max(sum(n for _, n in r) for _, r in cases)
        # Private (huge-page) memory: a read needs only the peer's arena shared.
        local = agent.allocate_arena(largest, shared=False)
        local.tensor.fill_(0)
        # memcpy baseline between two buffers of this process, timed right
        # before each pull so a noisy phase of the machine hits both.
        src = torch.ones(largest, dtype=torch.uint8)
        dst = torch.zeros(largest, dtype=torch.uint8)
        sweep = torch.zeros(_sweep_bytes(), dtype=torch.uint8)
        for (name, run_list), handle in zip(cases, handles, strict=True):
            offsets = local_offsets(run_list)
            at = sum(n for _, n in run_list)  # memcpy moves the same byte count
            pulls, copies, first = [], [], None
            for i in range(runs + 1):  # the first pull connects and maps: apart
                # Both start from a cold cache. Otherwise whichever ran second
                # finds the other's leftovers: the pull's streaming stores
                # leave memcpy's buffers in the cache, and memcpy evicts the
                # pull's source (memcpy was 15.8 GB/s warm, 12 GB/s cold here).
                sweep.add_(1)
                copy = time_once(lambda n=at: dst[:n].copy_(src[:n]))
                sweep.add_(1)
                start = time.perf_counter()
                await agent.read(handle, local, offsets, namespace=NAMESPACE, timeout=timeout)
                if i:
                    pulls.append(time.perf_counter() - start)
                    copies.append(copy)
                else:
                    first = time.perf_counter() - start
            out[name] = (pulls, copies, first)
        await agent.close()
    finally:
        pipe.send_bytes(b"stop")
        owner.join(30)
        if owner.is_alive():
            owner.kill()
    return out


def _sweep_bytes() -> int:
    """Twice the last-level cache (at least 64 MiB): writing it evicts the cache."""
    size = 32 << 20
    with contextlib.suppress(OSError, ValueError):
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text.rstrip("KMG")) * units.get(text[-1], 1)
    return max(64 << 20, 2 * size)


def _ucx_perftest(size: int, outstanding: int, iters: int, tls: str) -> float | None:
    """ucx_perftest ucp_get bandwidth in bytes/s, or None if it cannot run."""
    try:
        import libucx
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    exe = root / "bin" / "ucx_perftest"
    if not exe.exists():
        return None
    env = os.environ | {"LD_LIBRARY_PATH": str(root / "lib"), "UCX_TLS": tls}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    server = subprocess.Popen(
        [str(exe), "-p", port], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)
        cmd = [
            str(exe),
            "127.0.0.1",
            "-p",
            port,
            "-t",
            "ucp_get",
            "-s",
            str(size),
            "-n",
            str(iters),
            "-w",
            str(max(1, iters // 10)),
            "-O",
            str(outstanding),
        ]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    finally:
        server.kill()
        server.wait()
    final = [line for line in result.stdout.splitlines() if line.startswith("Final:")]
    if not final:
        return None
    numbers = re.findall(r"[\d.]+", final[-1])
    return float(numbers[5]) * 2**20  # bandwidth overall, UCX's MB/s = MiB/s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arena-mib", type=int, default=1024)
    parser.add_argument("--sizes-mib", default="1,16,256", help="single-run pull sizes")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--run-kib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--modes", default=None, help=f"comma-separated (default {','.join(MODES)})"
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--no-perftest", action="store_true")
    parser.add_argument("--nixl", action=argparse.BooleanOptionalAction, default=None,
                        help="NIXL UCX READ of the same cases if importable (on)")  # fmt: skip
    parser.add_argument("--device", default="cpu",
                        help="cuda[:N]: pulls of GPU memory (bench/transfer_gpu.py)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the results here")


def run(args: argparse.Namespace) -> dict:
    if args.device != "cpu":
        return _run_on_gpu(args)
    modes = [m for m in (args.modes or ",".join(MODES)).split(",") if m]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {list(MODES)}")
    arena = args.arena_mib << 20
    sizes = [int(s) for s in args.sizes_mib.split(",") if s]
    cases = _cases(arena, sizes, args.batch, args.run_kib)
    from kvrelay.transfer.calibrate import calibrate

    # Measured afresh and cached: the agents the bench starts use this plan.
    plan_load = os.getloadavg()
    plan = calibrate(fresh=True)
    host = transfer_host.host_lines(plan)
    print("\n".join(host), flush=True)
    saved_tls = os.environ.get("UCX_TLS")
    try:
        pulls = {
            mode: asyncio.run(_pull(mode, cases, arena, args.runs, args.timeout)) for mode in modes
        }
    finally:
        os.environ.pop("UCX_TLS", None)
        if saved_tls is not None:
            os.environ["UCX_TLS"] = saved_tls
    wants_nixl = args.nixl is not False
    nixl = nixl_peer.measure(cases, arena, args.runs, args.timeout) if wants_nixl else None
    results, rows, nixl_lines = [], [], []
    # The fast path's copy without a second process: the same runs out of a
    # shared arena like the owner's, with the calibrated copy and the kernel's.
    from kvrelay.transfer.arena import Arena

    source = Arena.allocate_shared(0, arena)
    source.tensor.fill_(1)
    sweep = torch.zeros(_sweep_bytes(), dtype=torch.uint8)
    for name, run_list in cases:
        nbytes = sum(n for _, n in run_list)
        memcpy = Summary.of([t for mode in modes for t in pulls[mode][name][1]])
        offsets = local_offsets(run_list)
        same = transfer_host.same_runs_baselines(source, run_list, offsets, args.runs, plan, sweep)
        runs_copy, kernel_copy = same["memcpy"], same["readv"]
        stream = tcp_stream(nbytes, args.runs) if "tcp" in modes else None
        perftest, perftest_runs = {}, {}
        if not args.no_perftest:
            count, size = len(run_list), run_list[0][1]
            outstanding = count if count > 1 else 1
            iters = max(20, min(2000, (4 << 30) // nbytes * outstanding))
            for label, tls in (("shm/cma", "sm,self"), ("tcp", "tcp,self")):
                # Several runs, like the pulls: one run of it varied 2x here.
                rates = [_ucx_perftest(size, outstanding, iters, tls) for _ in range(3)]
                rates = sorted(r for r in rates if r)
                perftest_runs[label] = rates
                perftest[label] = rates[len(rates) // 2] if rates else None
        entry = {
            "case": name,
            "bytes": nbytes,
            "memcpy": memcpy.to_json(),
            "ucx_perftest_bytes_per_s": perftest,
            "ucx_perftest_runs_bytes_per_s": perftest_runs,
            "modes": {},
        }
        for mode in modes:
            pull_times, copy_times, first = pulls[mode][name]
            summary = Summary.of(pull_times)
            ratio = Summary.of([c / t for c, t in zip(copy_times, pull_times, strict=True)])
            entry["modes"][mode] = summary.to_json() | {
                "x_memcpy": ratio.to_json(),
                "first_pull_s": first,  # connects (and maps): the cold case
            }
            if mode == "tcp":
                base = nbytes / stream.median if stream else None
            else:
                base = perftest.get("tcp" if mode == "ucx (tcp)" else "shm/cma")
            rows.append(
                [
                    name,
                    mode,
                    _gbs(nbytes, summary.median),
                    _spread(nbytes, summary),
                    f"{ratio.median:.2f} [{ratio.min:.2f}-{ratio.max:.2f}]",
                    f"{nbytes / summary.median / base:.2f}" if base else "-",
                    _gbs(nbytes, first),
                ]
            )
        rows.append(
            [name, "memcpy", _gbs(nbytes, memcpy.median), _spread(nbytes, memcpy), "1.00", "-", "-"]
        )
        rows.append(
            [
                name,
                "memcpy of the runs, 1 process",
                _gbs(nbytes, runs_copy.median),
                _spread(nbytes, runs_copy),
                f"{memcpy.median / runs_copy.median:.2f}",
                "-",
                "-",
            ]
        )
        rows.append(
            [
                name,
                "process_vm_readv of the runs, 1 call",
                _gbs(nbytes, kernel_copy.median),
                _spread(nbytes, kernel_copy),
                f"{memcpy.median / kernel_copy.median:.2f}",
                "-",
                "-",
            ]
        )
        entry["memcpy_of_runs_one_process"] = runs_copy.to_json() | {"copy": same["copy"]}
        entry["process_vm_readv_of_runs_one_call"] = kernel_copy.to_json()
        if stream is not None:
            entry["tcp_stream"] = stream.to_json()
            ratio = f"{memcpy.median / stream.median:.2f}"
            rows.append([name, "TCP stream, loopback", _gbs(nbytes, stream.median),
                         _spread(nbytes, stream), ratio, "-", "-"])  # fmt: skip
        for label, rate in perftest.items():
            rates = perftest_runs[label]
            spread = f"{rates[0] / 1e9:.2f}-{rates[-1] / 1e9:.2f}" if rates else "-"
            gbs = f"{rate / 1e9:.2f}" if rate else "n/a"
            rows.append([name, f"ucx_perftest ({label})", gbs, spread, "-", "-", "-"])
        if nixl:
            rows.append([*nixl_peer.table_row(name, nbytes, nixl[name], memcpy.median), "-"])
            our = {mode: pulls[mode][name][0] for mode in modes}
            entry["nixl_ucx_read"] = nixl_peer.case_json(nixl[name], our)
            nixl_lines.append(nixl_peer.ratio_line(name, nixl[name], our))
        results.append(entry)
    source.close()
    headers = ["case", "path", "GB/s", "[min-max]", "x memcpy", "x baseline", "first pull"]
    print(format_table(headers, rows))
    print(
        f"median of {args.runs} runs [slowest-fastest]; x memcpy = memcpy time / pull time per "
        "run (Tensor.copy_ of the same byte count, timed before each pull, both from a cold "
        "cache); first pull = GB/s of the untimed first pull (connects, maps: the cold case; "
        "the goals are on the steady state); "
        "x baseline = pull rate / ucx_perftest ucp_get rate on the same transport (ucx modes; "
        "median of 3 runs), "
        "/ a plain loopback TCP stream of the same bytes (tcp)"
    )
    for line in nixl_lines:
        print(line)
    summary = transfer_host.goals(results)
    end_load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        "\n".join(
            [*transfer_host.goal_lines(summary), *host, f"load average at the end: {end_load}"]
        )
    )
    payload = {
        "benchmark": "transfer",
        "config": {k: v for k, v in vars(args).items() if not callable(v)},
        "machine": machine_info(),
        "host": plan.host,
        "load_average": {"start": plan_load, "end": os.getloadavg()},
        "copy_plan": plan.to_json(),
        "results": results,
        "goals": summary,
    }
    if args.json:
        write_json(args.json, payload)
    return payload


def _run_on_gpu(args: argparse.Namespace) -> dict:
    from kvrelay.bench import transfer_gpu
    from kvrelay.model.device import DeviceError, parse_device

    try:
        device = parse_device(args.device)
    except DeviceError as exc:
        raise SystemExit(f"kvrelay bench transfer: {exc}") from None
    if device.type != "cuda":
        raise SystemExit("kvrelay bench transfer: --device is cpu (the default) or cuda[:N]")
    host_only = {"--modes": args.modes, "--nixl": args.nixl, "--no-perftest": args.no_perftest}
    given = [flag for flag, value in host_only.items() if value]
    if given:
        raise SystemExit(f"kvrelay bench transfer --device cuda: {', '.join(given)} are host-only")
    return transfer_gpu.run(args, device)


def _gbs(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}"


def _spread(nbytes: int, s: Summary) -> str:
    return f"{nbytes / s.max / 1e9:.2f}-{nbytes / s.min / 1e9:.2f}"
