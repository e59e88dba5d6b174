"""`kvrelay bench cache --workloads` and several `--servers`: the sweep of
every policy against LRU, and the workloads' help."""

import json

import pytest

from kvrelay.cache.eviction import DEFAULT_POLICY
from kvrelay.cli import main


def test_bench_cache_sweeps_workloads_and_servers_against_lru(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    main(["bench", "cache", "--workloads", "short-sessions,scan", "--servers", "1,2",
          "--capacities", "100,400", "--policies", "prefix-lirs", "--json", str(out),
          "--no-progress"])  # fmt: skip
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert {(r["workload"], r["servers"], r["capacity_pages"]) for r in rows} == {
        (w, s, c) for w in ("short-sessions", "scan") for s in (1, 2) for c in (100, 400)
    }
    for row in rows:
        assert set(row["rates"]) == {"lru", DEFAULT_POLICY, "prefix-lirs"}
        assert row["diff"]["lru"] == 0.0
        assert row["belady"] >= row["oracle-dead"] - 1e-12
        # A file L3 of each server's share of the working set: the optimum.
        assert row["default_l3"] >= 0.97 * row["infinite"]
    worst = payload["worst"][DEFAULT_POLICY]
    assert worst["diff"] == min(r["diff"][DEFAULT_POLICY] for r in rows)
    printed = capsys.readouterr().out
    assert "worst difference from LRU" in printed and "short-sessions" in printed


def test_bench_cache_workloads_are_named_in_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # no line breaks inside a name
    with pytest.raises(SystemExit):
        main(["bench", "cache", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("agentic", "agentic-jitter", "floods", "scan", "short-sessions",
                 "long-sessions", "system-prompts"):  # fmt: skip
        assert f"{name}:" in text
