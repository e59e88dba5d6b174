"""`kvrelay bench transfer`: page pulls between two processes on this host.

A publishing agent in a spawned process owns an arena (default 1 GiB) and
publishes single runs (1, 16, 256 MiB) and a batch of 512 random 64 KiB
runs. This process pulls each of them `--runs` times per mode: ucx over
shm/cma, ucx over tcp (UCX_TLS), the tcp backend and the same-host fast path,
then NIXL reads them; all of that `--rounds` times in turn, the runs pooled.
Baselines measured in the same run: memcpy (`Tensor.copy_`) of the same byte
count, `ucx_perftest` from the UCX wheel (`ucp_get`, `-O 512` for the batch),
and for the tcp backend a plain loopback TCP stream of the same bytes.
When NIXL is installed, its UCX READ of the same cases (`nixl_peer`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import subprocess
import time
from pathlib import Path

# torch's OpenMP workers spin-wait after each parallel region, and the
# memcpy baseline and the cache sweep run right before every timed pull: on
# a 2-core host the spinning took a core from the pull's own threads (15-30%
# of a tcp pull). Passive workers sleep at once. Set before torch
# loads OpenMP (no effect where it already has) and inherited by every
# process the bench spawns (owners, the NIXL peer), so all are timed alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from kvrelay.bench import nixl_peer, transfer_host, transfer_netns
from kvrelay.bench.stats import Summary, format_table, machine_info, time_once, write_json
from kvrelay.bench.tcp_stream import tcp_stream
from kvrelay.bench.transfer_pulls import (
    TOKEN,
    bench_cases,
    local_offsets,
    owner_process,
    publish_until_stopped,
    restored_ucx_tls,
    sweep_bytes,
    timed_pulls,
)

MODES = {  # name: (backend, UCX_TLS, fast path)
    "ucx (shm/cma)": ("ucx", "sm,self", False),
    "ucx (tcp)": ("ucx", "tcp,self", False),
    "tcp": ("tcp", None, False),
    "fast path": ("ucx", None, True),
}


def _owner(pipe, backend, tls, fast, arena_bytes, runs_list) -> None:
    if tls:
        os.environ["UCX_TLS"] = tls
    asyncio.run(_own(pipe, backend, fast, arena_bytes, runs_list))


async def _own(pipe, backend, fast, arena_bytes, runs_list) -> None:
    from kvrelay.transfer import create_agent

    agent = await create_agent(backend, token=TOKEN, fast_path=fast, lease_seconds=3600)
    arena = agent.allocate_arena(arena_bytes)
    arena.tensor.fill_(1)  # touch every page
    await publish_until_stopped(pipe, agent, arena, runs_list)


async def _pull(mode: str, cases, arena_bytes: int, runs: int, timeout: float) -> dict:
    """name -> (pull seconds, memcpy seconds, first pull seconds) per case."""
    from kvrelay.transfer import create_agent

    backend, tls, fast = MODES[mode]
    if tls:
        os.environ["UCX_TLS"] = tls
    else:
        os.environ.pop("UCX_TLS", None)
    args = (backend, tls, fast, arena_bytes, [r for _, r in cases])
    with owner_process(_owner, args) as handles:
        agent = await create_agent(backend, token=TOKEN, fast_path=fast)
        largest = max(sum(n for _, n in r) for _, r in cases)
        # Private (huge-page) memory: a read needs only the peer's arena shared.
        local = agent.allocate_arena(largest, shared=False)
        local.tensor.fill_(0)
        # memcpy baseline between two buffers of this process.
        src = torch.ones(largest, dtype=torch.uint8)
        dst = torch.zeros(largest, dtype=torch.uint8)
        sweep = torch.zeros(sweep_bytes(), dtype=torch.uint8)

        def cold_memcpy(n: int) -> float:
            # Both start from a cold cache. Otherwise whichever ran second
            # finds the other's leftovers: the pull's streaming stores
            # leave memcpy's buffers in the cache, and memcpy evicts the
            # pull's source (memcpy was 15.8 GB/s warm, 12 GB/s cold here).
            sweep.add_(1)
            copy = time_once(lambda: dst[:n].copy_(src[:n]))
            sweep.add_(1)
            return copy

        out = await timed_pulls(agent, local, cases, handles, runs, timeout, cold_memcpy)
        await agent.close()
    return out


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
    parser.add_argument("--runs", type=int, default=3, help="timed pulls per case, mode and round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every mode and NIXL in turn; the runs of all rounds "
                             "are pooled")  # fmt: skip
    parser.add_argument(
        "--modes", default=None, help=f"comma-separated (default {','.join(MODES)})"
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--no-perftest", action="store_true")
    parser.add_argument("--nixl", action=argparse.BooleanOptionalAction, default=None,
                        help="NIXL UCX READ of the same cases if importable (on)")  # fmt: skip
    parser.add_argument("--device", default="cpu",
                        help="cuda[:N]: pulls of GPU memory (bench/transfer_gpu.py)")  # fmt: skip
    parser.add_argument("--netns", action="store_true", help="across two network namespaces")
    parser.add_argument("--json", metavar="PATH", help="write the results here")


def run(args: argparse.Namespace) -> dict:
    if args.netns or args.device != "cpu":
        return transfer_netns.run(args) if args.netns else _run_on_gpu(args)
    modes = _modes(args.modes)
    arena, cases = bench_cases(args)
    from kvrelay.transfer.calibrate import calibrate

    # Measured afresh and cached: the agents the bench starts use this plan.
    plan_load = os.getloadavg()
    plan = calibrate(fresh=True)
    host = transfer_host.host_lines(plan)
    print("\n".join(host), flush=True)
    pulls, nixl = _rounds(args, modes, cases, arena)
    results, rows, nixl_lines = _compare(args, modes, cases, arena, pulls, nixl, plan)
    _print_table(args.runs * args.rounds, rows, nixl_lines)
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


def _rounds(args, modes, cases, arena: int) -> tuple[dict, dict | None]:
    """Every mode's pulls and NIXL's reads, in `args.rounds` rounds of each in
    turn, pooled: a slow phase of the machine (another process, a frequency
    change) then falls on every mode and on NIXL alike instead of on
    whichever ran in it. The first pull kept is the first round's."""
    if args.runs < 1 or args.rounds < 1:
        raise SystemExit("kvrelay bench transfer: --runs and --rounds must be >= 1")
    pulls: dict = {mode: {} for mode in modes}
    nixl: dict | None = {} if args.nixl is not False else None
    for _ in range(args.rounds):
        with restored_ucx_tls():
            for mode in modes:
                got = asyncio.run(_pull(mode, cases, arena, args.runs, args.timeout))
                for name, (times, baselines, first) in got.items():
                    kept = pulls[mode].setdefault(name, ([], [], first))
                    kept[0].extend(times)
                    kept[1].extend(baselines)
        if nixl is not None:
            reads = nixl_peer.measure(cases, arena, args.runs, args.timeout)
            if reads is None:  # absent or failed (the reason is printed): no NIXL rows
                nixl = None
                continue
            for name, (prepared, per_read) in reads.items():
                kept = nixl.setdefault(name, ([], []))
                kept[0].extend(prepared)
                kept[1].extend(per_read)
    return pulls, nixl


def _modes(text: str | None) -> list[str]:
    modes = [m for m in (text or ",".join(MODES)).split(",") if m]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {list(MODES)}")
    return modes


def _compare(args, modes, cases, arena: int, pulls: dict, nixl, plan) -> tuple[list, list, list]:
    """Each case's JSON entry, table rows and NIXL line: the pulls beside the
    baselines, the one-process ones measured here."""
    results, rows, nixl_lines = [], [], []
    # The fast path's copy without a second process: the same runs out of a
    # shared arena like the owner's, with the calibrated copy and the kernel's.
    from kvrelay.transfer.arena import Arena

    source = Arena.allocate_shared(0, arena)
    source.tensor.fill_(1)
    sweep = torch.zeros(sweep_bytes(), dtype=torch.uint8)
    for name, run_list in cases:
        nbytes = sum(n for _, n in run_list)
        memcpy = Summary.of([t for mode in modes for t in pulls[mode][name][1]])
        offsets = local_offsets(run_list)
        samples = args.runs * args.rounds
        same = transfer_host.same_runs_baselines(source, run_list, offsets, samples, plan, sweep)
        stream = tcp_stream(nbytes, samples, sweep) if "tcp" in modes else None
        perftest, perftest_runs = ({}, {}) if args.no_perftest else _perftests(run_list)
        case_pulls = {mode: pulls[mode][name] for mode in modes}
        modes_json, mode_rows = _mode_rows(name, nbytes, case_pulls, perftest, stream)
        entry = {
            "case": name,
            "bytes": nbytes,
            "memcpy": memcpy.to_json(),
            "ucx_perftest_bytes_per_s": perftest,
            "ucx_perftest_runs_bytes_per_s": perftest_runs,
            "modes": modes_json,
            "memcpy_of_runs_one_process": same["memcpy"].to_json() | {"copy": same["copy"]},
            "process_vm_readv_of_runs_one_call": same["readv"].to_json(),
        }
        rows += mode_rows
        rows += _baseline_rows(name, nbytes, memcpy, same, stream, perftest, perftest_runs)
        if stream is not None:
            entry["tcp_stream"] = stream.to_json()
        if nixl:
            prepared, per_read = nixl[name]
            per_label = nixl_peer.PER_READ_LABEL
            rows.append([*nixl_peer.table_row(name, nbytes, prepared, memcpy.median), "-"])
            rows.append(
                [*nixl_peer.table_row(name, nbytes, per_read, memcpy.median, per_label), "-"]
            )
            our = {mode: pulls[mode][name][0] for mode in modes}
            entry["nixl_ucx_read"] = nixl_peer.case_json(prepared, our)
            entry["nixl_ucx_read_descriptors_per_read"] = nixl_peer.case_json(per_read, our)
            nixl_lines.append(nixl_peer.ratio_line(name, prepared, our))
            nixl_lines.append(nixl_peer.ratio_line(name, per_read, our, per_label))
        results.append(entry)
    source.close()
    return results, rows, nixl_lines


def _perftests(run_list) -> tuple[dict, dict]:
    """ucx_perftest's median rate and its sorted rates per transport."""
    nbytes = sum(n for _, n in run_list)
    count, size = len(run_list), run_list[0][1]
    outstanding = count if count > 1 else 1
    iters = max(20, min(2000, (4 << 30) // nbytes * outstanding))
    perftest, perftest_runs = {}, {}
    for label, tls in (("shm/cma", "sm,self"), ("tcp", "tcp,self")):
        # Several runs, like the pulls: one run of it varied 2x here.
        rates = [_ucx_perftest(size, outstanding, iters, tls) for _ in range(3)]
        rates = sorted(r for r in rates if r)
        perftest_runs[label] = rates
        perftest[label] = rates[len(rates) // 2] if rates else None
    return perftest, perftest_runs


def _mode_rows(name: str, nbytes: int, case_pulls: dict, perftest: dict, stream):
    """Each mode's JSON and table row for one case."""
    modes_json, rows = {}, []
    for mode, (pull_times, copy_times, first) in case_pulls.items():
        summary = Summary.of(pull_times)
        ratio = Summary.of([c / t for c, t in zip(copy_times, pull_times, strict=True)])
        modes_json[mode] = summary.to_json() | {
            "x_memcpy": ratio.to_json(),
            "first_pull_s": first,  # connects (and maps): the cold case
        }
        if mode == "tcp":
            base = nbytes / stream.median if stream else None
        else:
            base = perftest.get("tcp" if mode == "ucx (tcp)" else "shm/cma")
        rows.append([
            name, mode, _gbs(nbytes, summary.median), _spread(nbytes, summary),
            f"{ratio.median:.2f} [{ratio.min:.2f}-{ratio.max:.2f}]",
            f"{nbytes / summary.median / base:.2f}" if base else "-", _gbs(nbytes, first),
        ])  # fmt: skip
    return modes_json, rows


def _baseline_rows(name, nbytes, memcpy, same, stream, perftest, perftest_runs) -> list[list]:
    """The baselines' table rows for one case (x memcpy = memcpy time / theirs)."""
    runs_copy, kernel_copy = same["memcpy"], same["readv"]
    baselines = [("memcpy of the runs, 1 process", runs_copy)]
    baselines.append(("process_vm_readv of the runs, 1 call", kernel_copy))
    if stream is not None:
        baselines.append(("TCP stream, loopback", stream))
    rows = [
        [name, "memcpy", _gbs(nbytes, memcpy.median), _spread(nbytes, memcpy), "1.00", "-", "-"]
    ]
    for label, s in baselines:
        ratio = f"{memcpy.median / s.median:.2f}"
        rows.append([name, label, _gbs(nbytes, s.median), _spread(nbytes, s), ratio, "-", "-"])
    for label, rate in perftest.items():
        rates = perftest_runs[label]
        spread = f"{rates[0] / 1e9:.2f}-{rates[-1] / 1e9:.2f}" if rates else "-"
        gbs = f"{rate / 1e9:.2f}" if rate else "n/a"
        rows.append([name, f"ucx_perftest ({label})", gbs, spread, "-", "-", "-"])
    return rows


def _print_table(runs: int, rows: list, nixl_lines: list[str]) -> None:
    headers = ["case", "path", "GB/s", "[min-max]", "x memcpy", "x baseline", "first pull"]
    print(format_table(headers, rows))
    print(
        f"median of {runs} runs [slowest-fastest]; x memcpy = memcpy time / pull time per "
        "run (Tensor.copy_ of the same byte count, timed before each pull, both from a cold "
        "cache); first pull = GB/s of the untimed first pull (connects, maps: the cold case; "
        "the goals are on the steady state); x baseline = pull rate / ucx_perftest ucp_get "
        "rate on the same transport (ucx modes; median of 3 runs), "
        "/ a plain loopback TCP stream of the same bytes (tcp)"
    )
    for line in nixl_lines:
        print(line)


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
