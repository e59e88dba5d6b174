"""`kvrelay bench sglang-server`'s request-by-request comparison of two modes."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from kvrelay.bench.sglang_server import paired, request_order


def test_paired_compares_the_same_requests_of_two_modes():
    results = {"kvrelay": {"ttfts_s": [1.0, 2.0, 3.0, 4.0]},
               "file": {"ttfts_s": [2.0, 2.0, 2.0, 2.0]}}  # fmt: skip
    pair = paired(results, "kvrelay", "file")
    assert pair["median_ratio"] == pytest.approx(1.25)
    assert pair["faster"] == 1 and pair["requests"] == 4
    assert pair["p25_ratio"] <= pair["median_ratio"] <= pair["p75_ratio"]
    assert paired({"kvrelay": results["kvrelay"]}, "kvrelay", "file") is None


def test_paired_refuses_runs_of_different_lengths():
    with pytest.raises(ValueError):
        paired({"a": {"ttfts_s": [1.0]}, "b": {"ttfts_s": [1.0, 2.0]}}, "a", "b")


def test_request_order_balances_places_and_predecessors():
    modes = ["kvrelay", "file", "none"]
    orders = [request_order(modes, j) for j in range(2 * len(modes))]
    assert all(sorted(o) == sorted(modes) for o in orders)
    places = Counter((m, o.index(m)) for o in orders for m in o)
    assert set(places.values()) == {2}  # every mode in every place twice
    follows = Counter(pair for o in orders for pair in itertools.pairwise(o))
    assert len(follows) == 6 and set(follows.values()) == {2}  # each after each other
