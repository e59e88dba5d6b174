"""`kvrelay bench sglang-server`'s request-by-request comparison of two modes."""

from __future__ import annotations

import pytest

from kvrelay.bench.sglang_server import paired


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
