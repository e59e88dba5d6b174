"""What each listening server accepts, as far as a fuzzer needs to know:
a valid-looking request per op (the fields a server must check), and
values out of range for each field. Every generated case is invalid by
construction, so any answer but a typed refusal is a finding."""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, field

import msgpack

KEY = b"\x11" * 32


def packed(*pairs) -> bytes:
    return b"".join(struct.pack("<QQ", o % 2**64, n % 2**64) for o, n in pairs)


BAD_LEASE_S = (0, -1, -(2**63), math.nan, math.inf, -math.inf, 1e308, True)


@dataclass(slots=True)
class Target:
    """A server under test. `ops`: op -> request; `bad`: field -> invalid values."""

    name: str
    address: str
    token: str
    ops: dict[str, dict] = field(default_factory=dict)
    bad: dict[str, list] = field(default_factory=dict)
    forged: list[dict] = field(default_factory=list)  # whole requests with forged handles
    dead_leases: list[dict] = field(default_factory=list)  # replayed / expired lease requests
    checked: dict[str, tuple[str, ...]] = field(default_factory=dict)  # op -> checked fields
    good: dict = field(default_factory=dict)  # a request the server must answer ok

    def request(self, rng: random.Random) -> tuple[str, dict]:
        op = rng.choice(sorted(self.ops))
        return op, dict(self.ops[op])

    def field_of(self, rng: random.Random, op: str) -> str:
        return rng.choice(self.checked[op])


def cache_target(
    address: str, token: str, page_bytes: int, ns: bytes, lease: int, dead: list[int]
) -> Target:
    """A cache server; `lease` is a live reservation lease of one key, `dead`
    leases released or expired."""
    runs = [[0, page_bytes]]
    ops = {
        "lookup": {"op": "lookup", "keys": [KEY], "lease_s": 5.0, "ns": ns},
        "reserve": {"op": "reserve", "keys": [KEY], "lease_s": 5.0, "ns": ns},
        "handle": {"op": "handle", "lease": lease, "count": 1, "runs": runs, "ns": ns},
        "commit": {"op": "commit", "keys": [KEY], "runs": runs},
        "flush": {"op": "flush", "ns": ns},
    }
    checked = {
        "lookup": ("keys", "lease_s", "ns"),
        "reserve": ("keys", "lease_s", "ns"),
        "handle": ("lease", "count", "runs", "ns"),
        "commit": ("keys", "runs"),
        "flush": ("ns",),
    }
    bad = {
        "keys": [[b"\x00" * 31], [b"\x00" * 33], [KEY, "k"], [[KEY]], [KEY, 7]],
        "lease_s": [*BAD_LEASE_S, 301],
        "ns": [b"\x00" * 31, b"\x00" * 33, b""],
        "count": [0, -1, 2, 2**63 - 1, -(2**63), True, 1.0],
        "lease": [0, -1, 2**63 - 1, lease + 10**6, True],
        "runs": [
            [[page_bytes, 1]],
            [[-1, 10]],
            [[0, 0]],
            [[0, page_bytes + 1]],
            [[2**63 - 1, 2**63 - 1]],
            [],
            [[0]],
            [[0, 1, 2]],
            [[0.0, 1]],
            [[True, 1]],
            [[page_bytes - 1, 2]],
        ],
    }
    forged = [dict(ops["handle"], lease=v) for v in (12345678, -5, 2**62)]
    dead_leases = [dict(ops["handle"], lease=d) for d in dead]
    return Target("cache", address, token, ops, bad, forged, dead_leases, checked, {"op": "stats"})


def agent_target(
    address: str, token: str, arena: int, size: int, lease: int, dead: list[int]
) -> Target:
    """A transfer agent's control listener; `lease` is live on `arena`,
    `dead` are leases released or expired there."""
    ok_runs = packed((0, 16))
    ops = {
        "read": {"op": "read", "arena": arena, "lease": lease, "runs": ok_runs},
        "write": {"op": "write", "arena": arena, "lease": lease, "runs": ok_runs},
    }
    checked = {"read": ("arena", "lease", "runs"), "write": ("arena", "lease", "runs")}
    bad = {
        "arena": [0, -1, arena + 1000, 2**63 - 1, -(2**63), 2**64 - 1],
        "lease": [0, -1, lease + 10**6, 2**63 - 1, 2**64 - 1],
        "runs": [
            packed((size, 1)),
            packed((size - 1, 2)),
            packed((2**64 - 1, 2)),
            packed((0, 0)),
            packed((0, 2**64 - 1)),
            packed((2**63, 2**63)),
            b"\x00" * 15,
            b"\x00" * 17,
            [[-1, 4]],
            [[0, size + 1]],
            [[0, 2**64 - 1]],
            [[size, 0]],
            packed(*[(0, 16)] * 2) + b"\x00",
            packed(*[(size - 8, 16)] * 3),
        ],
    }
    forged = [
        dict(ops["read"], arena=arena, lease=lease + 500),
        dict(ops["read"], arena=arena + 1, lease=lease),
        dict(ops["write"], lease=lease + 501),
    ]
    dead_leases = [dict(ops[op], lease=d) for d in dead for op in ("read", "write")]
    return Target("agent", address, token, ops, bad, forged, dead_leases, checked, {"op": "arenas"})


WORKER_PARAMS = {
    "max_new_tokens": 4,
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "seed": 0,
    "stop_token_ids": [],
}


def worker_target(
    role: str, address: str, token: str, vocab: int, page_size: int, handle: bytes
) -> Target:
    """A prefill or decode worker's front; `handle` a real handle that decode
    may not use (another namespace, or a released lease)."""
    tokens = struct.pack("<3I", 1, 2, 3)  # token ids travel packed (uint32)
    if role == "prefill":
        request = {"op": "prefill", "rid": "h", "tokens": tokens, "params": dict(WORKER_PARAMS),
                   "lease_s": 5.0}  # fmt: skip
        checked = ("tokens", "params", "lease_s")
    else:
        request = {"op": "decode", "rid": "h", "tokens": tokens, "first_token": 4,
                   "params": dict(WORKER_PARAMS), "tier_pages": 0, "pages": 1,
                   "handles": [{"handle": handle, "runs": [[0, 8]]}]}  # fmt: skip
        checked = ("tokens", "first_token", "params", "tier_pages", "pages", "handles")
    forged = _forged_handles(request, handle) if role == "decode" else []
    return Target(role, address, token, {role: request}, _worker_bad(role, vocab, handle),
                  forged, [], {role: checked}, {"op": "stats"})  # fmt: skip


def _worker_bad(role: str, vocab: int, handle: bytes) -> dict[str, list]:
    """Field -> invalid values for a worker's prefill or decode request."""
    params = [
        dict(WORKER_PARAMS, **{k: v})
        for k, v in (
            ("max_new_tokens", 0),
            ("max_new_tokens", -1),
            ("temperature", -1.0),
            ("temperature", math.nan),
            ("temperature", math.inf),
            ("top_p", 0.0),
            ("top_p", 1.5),
            ("top_p", math.nan),
            ("top_k", -1),
            ("seed", 1.5),
            ("stop_token_ids", [vocab]),
            ("stop_token_ids", [-1]),
            ("unknown", 1),
            ("max_new_tokens", True),
            ("top_k", 2**63 - 1 if role == "decode" else -5),
        )
    ]
    tokens = [b"", b"\x01\x00\x00", struct.pack("<I", vocab), struct.pack("<3I", 1, 2, vocab + 5),
              struct.pack("<I", 2**32 - 1), [1, 2], [True], "abc", 7]  # fmt: skip
    return {
        "tokens": tokens,
        "first_token": [-1, vocab, 2**63 - 1, True, 1.5],
        "params": params,
        "lease_s": [*BAD_LEASE_S, 3601],
        "tier_pages": [-1, -(2**63), True, 1.5],
        "pages": [-1, 0, 2, 2**63 - 1, True],
        "handles": [
            [{"handle": b"junk", "runs": [[0, 8]]}],
            [{"handle": handle}],
            [{"handle": handle, "runs": [[0]]}],
            [{"handle": handle, "runs": [[-1, 8]]}],
            [{"handle": handle, "runs": [[0, 2**63]]}],
            [{"runs": [[0, 8]]}],
        ],
    }


def _forged_handles(decode: dict, handle: bytes) -> list[dict]:
    """Decode requests whose handle is `handle` with one field forged."""
    fields = msgpack.unpackb(handle, raw=False)
    forged = []
    for change in (
        {"runs": packed((2**63, 8))},
        {"base": 0},
        {"arena": 999},
        {"agent": "127.0.0.1:1"},
        {"v": 99},
        {"expiry": 0.0},
        {"ns": b"\x00" * 32},
        {"lease": 10**9},
    ):
        raw = msgpack.packb(fields | change, use_bin_type=True)
        forged.append(dict(decode, handles=[{"handle": raw, "runs": [[0, 8]]}]))
    return forged
