"""`kvrelay bench transfer --netns`: page pulls between two hosts made of
network namespaces joined by a veth pair (`kvrelay.bench.netns`).

The owner (a spawned process in host A, 198.18.0.1) publishes the bench's
cases; a puller (a spawned process in host B, 198.18.0.2) pulls each of them
`--runs` times per mode, over the link only: ucx held to tcp (`UCX_TLS=tcp`)
and the tcp backend; each namespace counts as another host, so kvrelay's
fast path does not apply. Baseline in the same run: one plain TCP stream of
the same bytes from A to B (`tcp_stream` across the link). NIXL's UCX READ
of the same cases runs across the same link when NIXL is importable
(`nixl_peer`, its two processes placed like the owner and the puller).
Rounds alternate the modes, the stream and NIXL, and pool their runs.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import time

from kvrelay.bench import nixl_peer
from kvrelay.bench.netns import NetnsUnavailable, TwoHosts, enter
from kvrelay.bench.stats import Summary, format_table, machine_info, write_json
from kvrelay.bench.tcp_stream import tcp_stream
from kvrelay.bench.transfer_pulls import (
    TOKEN,
    bench_cases,
    owner_process,
    publish_until_stopped,
    timed_pulls,
)
from kvrelay.transfer import available

MODES = {"ucx (tcp)": "ucx", "tcp": "tcp"}
UCX_TLS = "tcp"


def _owner(pipe, namespace: str, host: str, backend: str, arena_bytes: int, runs_list) -> None:
    enter(namespace)
    os.environ["UCX_TLS"] = UCX_TLS
    asyncio.run(_own(pipe, host, backend, arena_bytes, runs_list))


async def _own(pipe, host, backend, arena_bytes, runs_list) -> None:
    from kvrelay.transfer import create_agent

    agent = await create_agent(backend, token=TOKEN, host=host, lease_seconds=3600)
    arena = agent.allocate_arena(arena_bytes)
    arena.tensor.fill_(1)  # touch every page
    await publish_until_stopped(pipe, agent, arena, runs_list)


def _puller(result, hosts: TwoHosts, mode: str, cases, arena_bytes, runs, timeout) -> None:
    """In host B: start the owner in host A, pull every case, send the times."""
    enter(hosts.names[1])
    os.environ["UCX_TLS"] = UCX_TLS
    backend = MODES[mode]
    args = (hosts.names[0], hosts.addresses[0], backend, arena_bytes, [r for _, r in cases])
    with owner_process(_owner, args) as handles:
        result.send(asyncio.run(_pull(backend, cases, handles, runs, timeout, hosts)))


async def _pull(backend, cases, handles, runs, timeout, hosts) -> dict:
    from kvrelay.transfer import create_agent

    agent = await create_agent(backend, token=TOKEN, host=hosts.addresses[1])
    largest = max(sum(n for _, n in r) for _, r in cases)
    local = agent.allocate_arena(largest, shared=False)
    local.tensor.fill_(0)
    out = await timed_pulls(agent, local, cases, handles, runs, timeout, lambda n: 0.0)
    await agent.close()
    return {name: (pulls, first) for name, (pulls, _, first) in out.items()}


def _streams(result, hosts: TwoHosts, cases, runs: int, timeout: float) -> None:
    """In host B: a TCP stream of each case's bytes from host A."""
    enter(hosts.names[1])
    sizes = {name: sum(n for _, n in r) for name, r in cases}
    result.send({
        name: tcp_stream(n, runs, timeout_s=timeout, host=hosts.addresses[0],
                         sender_netns=hosts.names[0]).runs
        for name, n in sizes.items()
    })  # fmt: skip


def _in_child(target, *args):
    """`target(pipe, *args)` in a spawned process; what it sends back."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    # Not a daemon: it starts processes of its own (the owner, the sender).
    child = ctx.Process(target=target, args=(send, *args))
    child.start()
    deadline = time.monotonic() + 600
    try:
        while not receive.poll(0.5):
            if not child.is_alive():
                raise RuntimeError(f"{target.__name__} exited {child.exitcode}, sending nothing")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{target.__name__} sent nothing within 600 s")
        return receive.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


def run(args) -> dict:
    modes = [m for m in MODES if MODES[m] != "ucx" or available("ucx")]
    arena, cases = bench_cases(args)
    try:
        hosts = TwoHosts("bench").create()
    except NetnsUnavailable as exc:
        raise SystemExit(f"kvrelay bench transfer --netns: {exc}") from None
    # SIGTERM (a timeout) unwinds too, so the namespaces never outlive the bench.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        pulls, streams, nixl = _rounds(args, hosts, modes, cases, arena)
    finally:
        hosts.remove()
        signal.signal(signal.SIGTERM, previous)
    results = _report(args, modes, cases, pulls, streams, nixl)
    link = {"hosts": list(hosts.addresses), "ucx_tls": UCX_TLS}
    config = {k: v for k, v in vars(args).items() if not callable(v)}
    payload = {"benchmark": "transfer-netns", "config": config, "machine": machine_info(),
               "link": link, "results": results}  # fmt: skip
    if args.json:
        write_json(args.json, payload)
    return payload


def _rounds(args, hosts, modes, cases, arena):
    pulls = {m: {} for m in modes}
    streams: dict = {}
    nixl: dict | None = {} if args.nixl is not False else None
    for _ in range(args.rounds):
        for mode in modes:
            got = _in_child(_puller, hosts, mode, cases, arena, args.runs, args.timeout)
            for name, (times, first) in got.items():
                pulls[mode].setdefault(name, ([], first))[0].extend(times)
        for name, times in _in_child(_streams, hosts, cases, args.runs, args.timeout).items():
            streams.setdefault(name, []).extend(times)
        if nixl is not None:
            reads = nixl_peer.measure(cases, arena, args.runs, args.timeout, netns=hosts)
            if reads is None:
                nixl = None
                continue
            for name, (prepared, _) in reads.items():
                nixl.setdefault(name, []).extend(prepared)
    return pulls, streams, nixl


def _report(args, modes, cases, pulls, streams, nixl) -> dict:
    rows, results = [], {}
    for name, run_list in cases:
        nbytes = sum(n for _, n in run_list)
        stream = Summary.of(streams[name])
        entry = {"bytes": nbytes, "tcp_stream": stream.to_json()}
        lines = [("TCP stream A->B", stream)]
        for mode in modes:
            times, first = pulls[mode][name]
            s = Summary.of(times)
            entry[mode] = s.to_json() | {"first_s": first}
            lines.append((mode, s))
        if nixl is not None and name in nixl:
            s = Summary.of(nixl[name])
            entry["nixl_ucx_read"] = s.to_json()
            lines.append(("NIXL UCX READ", s))
            for mode in modes:
                entry[f"x_nixl_{mode}"] = s.median / Summary.of(pulls[mode][name][0]).median
        for label, s in lines:
            rows.append([name, label, f"{nbytes / s.median / 1e9:.2f}",
                         f"{s.median * 1e3:.2f}", f"{s.spread:.0%}"])  # fmt: skip
        results[name] = entry
    headers = ["case", "what", "GB/s", "median ms", "spread"]
    print(format_table(headers, rows))
    if nixl is None:
        print("NIXL: not measured (absent, refused or --no-nixl)")
    count = args.runs * args.rounds
    print(f"{count} timed runs per row (median; spread: (max - min) / median); "
          f"link: veth, UCX_TLS={UCX_TLS}")  # fmt: skip
    return results
