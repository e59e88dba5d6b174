"""Families of hostile frames and the runner that sends them to a server.

Each case goes on its own connection. What counts as rejected correctly: a
typed refusal (`{op: "error", error: "<TypeName>"}`), or for a truncated
frame the server closing the connection (nobody is left to answer).
Anything else — an answer, no answer within the deadline, a reply that is
not typed — is counted against the server, and after each family a good
request must still be answered."""

from __future__ import annotations

import asyncio
import random
import struct
import time
from collections import Counter
from dataclasses import dataclass, field

import msgpack

from kvrelay.chaos import frames
from kvrelay.chaos.targets import Target
from kvrelay.chaos.values import nested_bytes, other_kind, wild

FAMILIES = (
    "truncated", "oversized", "garbage", "nested", "wrong_types", "out_of_range",
    "forged_handles", "dead_leases",
)  # fmt: skip
MAX_FRAME = 16 << 20
MAX_HELLO_FRAME = 64 << 10


@dataclass(slots=True)
class Case:
    payload: bytes
    hello: bool = True  # False: the payload is the first frame of the connection
    half_close: bool = False
    may_close: bool = False  # a close without an answer is correct too


@dataclass(slots=True)
class FamilyResult:
    family: str
    target: str
    tried: int = 0
    rejected: int = 0
    crashes: int = 0  # the server died, logged an unhandled error, or stopped serving
    outcomes: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # refusal type names
    samples: list = field(default_factory=list)  # a few cases not rejected correctly

    def add(self, other: FamilyResult) -> None:
        self.tried += other.tried
        self.rejected += other.rejected
        self.crashes += other.crashes
        self.outcomes += other.outcomes
        self.errors += other.errors
        self.samples = (self.samples + other.samples)[:5]

    def as_dict(self) -> dict:
        return {
            "family": self.family, "target": self.target, "tried": self.tried,
            "rejected": self.rejected, "crashes": self.crashes,
            "outcomes": dict(self.outcomes), "errors": dict(self.errors),
        }  # fmt: skip


def make_case(target: Target, family: str, rng: random.Random) -> Case | None:
    """One case of `family` for `target`; None when the family does not apply."""
    op, request = target.request(rng)
    if family == "truncated":
        data = frames.frame(request) if rng.random() < 0.7 else frames.hello(target.token)
        cut = rng.randrange(1, len(data))
        return Case(data[:cut], hello=rng.random() < 0.7, half_close=True, may_close=True)
    if family == "oversized":
        pre = rng.random() < 0.5
        limit = MAX_HELLO_FRAME if pre else MAX_FRAME
        length = rng.choice([limit + 1, limit + rng.randrange(1, 1 << 20), 2**32 - 1])
        return Case(struct.pack(">I", length) + rng.randbytes(rng.randrange(64)), hello=not pre)
    if family == "garbage":
        if rng.random() < 0.5:
            body = msgpack.packb(wild(rng), use_bin_type=True)
            if body[:1] and (0x80 <= body[0] <= 0x8F or body[0] in (0xDE, 0xDF)):
                body = b"\xc1" + body  # a map would be a valid frame: spoil it
        else:
            body = b"\xc1" + rng.randbytes(rng.randrange(200))  # 0xc1: never valid msgpack
        return Case(frames.raw_frame(body), hello=rng.random() < 0.8)
    if family == "nested":
        depth = rng.choice([64, 500, 1000, 3000, 100_000])
        if depth > 5000:  # a stream of nested arrays far deeper than any decoder stack
            body = b"\x81\xa2op\xa6lookup" + b"\x91" * depth + b"\xc0"
            return Case(frames.raw_frame(body))
        name = target.field_of(rng, op)
        del request[name]
        # Packed by hand: msgpack's own packer refuses nests this deep.
        body = bytes([0x80 | (len(request) + 1)])
        body += b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in request.items())
        body += msgpack.packb(name) + nested_bytes(rng, depth)
        return Case(frames.raw_frame(body), hello=rng.random() < 0.9)
    if family == "wrong_types":
        if rng.random() < 0.2:
            request["op"] = other_kind(rng, "op") if rng.random() < 0.5 else f"no-{rng.random()}"
        else:
            name = target.field_of(rng, op)
            request[name] = other_kind(rng, request[name])
        return Case(frames.frame(request))
    if family == "out_of_range":
        name = rng.choice([f for f in target.checked[op] if f in target.bad])
        request[name] = rng.choice(target.bad[name])
        return Case(frames.frame(request))
    if family == "forged_handles":
        return Case(frames.frame(rng.choice(target.forged))) if target.forged else None
    if family == "dead_leases":
        return Case(frames.frame(rng.choice(target.dead_leases))) if target.dead_leases else None
    raise ValueError(f"unknown family {family!r}")


async def run_case(target: Target, case: Case, timeout: float) -> frames.Outcome:
    return await frames.probe(
        target.address, case.payload, token=target.token if case.hello else None,
        half_close=case.half_close, timeout=timeout,
    )  # fmt: skip


async def run_family(target: Target, family: str, count: int, *, seed: int = 0,
                     concurrency: int = 8, timeout: float = 15.0, alive=None,
                     deadline: float | None = None) -> FamilyResult:  # fmt: skip
    """Sends `count` cases of `family` (those not started by the monotonic
    `deadline` are not sent, nor counted); `alive()` (optional) says whether
    the server's process is still up. Ends with a good request."""
    rng = random.Random(f"{seed}:{target.name}:{family}")
    result = FamilyResult(family, target.name)
    # Made one at a time (a nested case can be 100 KB: 10,000 at once would not fit).
    cases = (make_case(target, family, rng) for _ in range(count))

    async def sender() -> None:
        for case in cases:
            if deadline is not None and time.monotonic() > deadline:
                return
            if case is not None:
                await one(case)

    async def one(case: Case) -> None:
        try:
            outcome = await run_case(target, case, timeout)
        except OSError:
            outcome = frames.Outcome(frames.CLOSED if case.may_close else "refused_connect")
        result.tried += 1
        result.outcomes[outcome.kind] += 1
        good = outcome.kind == frames.REFUSED or (case.may_close and outcome.kind == frames.CLOSED)
        if outcome.kind == frames.REFUSED:
            result.errors[outcome.error] += 1
        if good:
            result.rejected += 1
        elif len(result.samples) < 5:
            result.samples.append((case.payload[:200], outcome.kind, outcome.reply))

    await asyncio.gather(*(sender() for _ in range(concurrency)))
    if not await still_serving(target) or (alive is not None and not alive()):
        result.crashes += 1
    return result


async def still_serving(target: Target) -> bool:
    try:
        reply = await frames.call(target.address, target.good, target.token, timeout=30)
    except (OSError, TimeoutError):
        return False
    return frames.accepted(reply)
