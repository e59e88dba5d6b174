import hashlib
from collections import Counter

import pytest

from kvrelay.layout.ring import HashRing

KEYS = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(20_000)]
SERVERS = [f"10.0.0.{i}:7400" for i in range(1, 6)]


def owners(ring: HashRing) -> list[str]:
    return [ring.server_for(k) for k in KEYS]


def test_keys_spread_evenly_over_servers():
    ring = HashRing(SERVERS)
    counts = Counter(owners(ring))
    assert set(counts) == set(SERVERS)
    fair = len(KEYS) / len(SERVERS)
    # 160 virtual nodes keep every share within about 15 % of fair.
    assert all(0.8 * fair < c < 1.2 * fair for c in counts.values()), counts


def test_placement_does_not_depend_on_the_order_servers_were_added():
    assert owners(HashRing(SERVERS)) == owners(HashRing(reversed(SERVERS)))


def test_adding_a_server_moves_only_its_share():
    before = owners(HashRing(SERVERS))
    ring = HashRing(SERVERS)
    ring.add("10.0.0.9:7400")
    after = owners(ring)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    # Every moved key went to the new server, and about 1/6 of keys moved.
    assert {a for _, a in moved} == {"10.0.0.9:7400"}
    assert 0.8 / 6 < len(moved) / len(KEYS) < 1.2 / 6
    assert after.count("10.0.0.9:7400") == len(moved)


def test_removing_a_server_moves_only_its_keys():
    before = owners(HashRing(SERVERS))
    ring = HashRing(SERVERS)
    ring.remove(SERVERS[2])
    after = owners(ring)
    for b, a in zip(before, after, strict=True):
        if b == SERVERS[2]:
            assert a != SERVERS[2]
        else:
            assert a == b
    # Its keys are shared among the others, not dumped on one neighbour.
    assert len({a for b, a in zip(before, after, strict=True) if b == SERVERS[2]}) >= 3


def test_remove_then_add_restores_placement():
    ring = HashRing(SERVERS)
    ring.remove(SERVERS[0])
    ring.add(SERVERS[0])
    assert owners(ring) == owners(HashRing(SERVERS))


def test_group_keeps_key_order_per_server():
    ring = HashRing(SERVERS)
    groups = ring.group(KEYS[:500])
    assert sorted(p for ps in groups.values() for p in ps) == list(range(500))
    for server, positions in groups.items():
        assert positions == sorted(positions)
        assert all(ring.server_for(KEYS[p]) == server for p in positions)


def test_errors():
    with pytest.raises(LookupError):
        HashRing().server_for(KEYS[0])
    ring = HashRing(["a"])
    with pytest.raises(ValueError):
        ring.add("a")
    with pytest.raises(ValueError):
        ring.remove("b")
    with pytest.raises(ValueError):
        HashRing(vnodes=0)
    assert ring.server_for(KEYS[0]) == "a" and "a" in ring and len(ring) == 1
