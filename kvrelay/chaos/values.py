"""Values a hostile peer puts in a frame: any msgpack type, extreme
numbers, deep nesting, and values of a different type than a field wants."""

from __future__ import annotations

import math
import random

INT_EXTREMES = (-(2**63), -(2**31), -1, 0, 1, 2**31, 2**32, 2**63 - 1, 2**64 - 1)
FLOAT_EXTREMES = (math.nan, math.inf, -math.inf, -0.0, 1e308, -1e308, 5e-324)


def nested_bytes(rng: random.Random, depth: int) -> bytes:
    """A msgpack list/map nest `depth` deep, packed by hand."""
    levels = (b"\x91" if rng.random() < 0.5 else b"\x81\xa1k" for _ in range(depth))
    return b"".join(levels) + rng.choice([b"\xc0", b"\x00", b"\xa1x"])


def scalar(rng: random.Random):
    kind = rng.randrange(7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice(INT_EXTREMES) if rng.random() < 0.5 else rng.randrange(-999, 999)
    if kind == 3:
        return rng.choice(FLOAT_EXTREMES) if rng.random() < 0.5 else rng.uniform(-1e6, 1e6)
    if kind == 4:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(40)))
    if kind == 5:
        return rng.randbytes(rng.choice([0, 1, 15, 16, 31, 32, 33, 100]))
    return rng.randbytes(rng.randrange(4)).hex()


def wild(rng: random.Random, depth: int = 3):
    """Any msgpack value: scalars, lists and maps of them."""
    if depth <= 0 or rng.random() < 0.5:
        return scalar(rng)
    if rng.random() < 0.5:
        return [wild(rng, depth - 1) for _ in range(rng.randrange(5))]
    return {str(scalar(rng))[:20]: wild(rng, depth - 1) for _ in range(rng.randrange(5))}


def kind_of(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, bytes):
        return "bytes"
    if isinstance(value, list | tuple):
        return "list"
    return "map"


def other_kind(rng: random.Random, value):
    """A value of another kind than `value` (a number for a list, ...); never
    None, which stands for a missing field and so for its default."""
    for _ in range(100):
        candidate = wild(rng)
        if kind_of(candidate) not in (kind_of(value), "none"):
            return candidate
    return object.__repr__(value)  # a string: never the kind a non-str field wants
