"""The optional NIXL peer of `kvrelay bench transfer`: its pure parts always,
a real NIXL READ between two processes only where NIXL is installed."""

import json

import numpy as np
import pytest
import torch

from kvrelay.bench import nixl_peer
from kvrelay.cli import main

needs_nixl = pytest.mark.skipif(nixl_peer.find_nixl() is None, reason="NIXL is not installed")


def test_descriptor_rows_pack_the_runs_back_to_back_locally():
    runs = [(4096, 100), (0, 50), (1 << 20, 8)]
    local, remote = nixl_peer.descriptor_rows(runs, local_base=1000, remote_base=7 << 30)
    assert local.tolist() == [[1000, 100, 0], [1100, 50, 0], [1150, 8, 0]]
    assert remote.tolist() == [[(7 << 30) + 4096, 100, 0], [7 << 30, 50, 0],
                               [(7 << 30) + (1 << 20), 8, 0]]  # fmt: skip
    assert local.dtype == remote.dtype == np.int64


def test_descriptor_rows_land_a_repeated_run_in_one_place_as_the_pulls_do():
    local, remote = nixl_peer.descriptor_rows([(64, 8)] * 3, local_base=1000, remote_base=0)
    assert local[:, 0].tolist() == [1000] * 3 and remote[:, 0].tolist() == [64] * 3


@pytest.mark.parametrize("runs", [[], [(0, 0)], [(-8, 8)]])
def test_descriptor_rows_reject_empty_and_negative_runs(runs):
    with pytest.raises(ValueError):
        nixl_peer.descriptor_rows(runs, 0, 0)


def test_check_landed_finds_a_run_at_the_wrong_place():
    source = torch.arange(64, dtype=torch.int64)  # the owner's pattern: word i holds i
    runs = [(256, 64), (0, 64)]
    local = torch.cat([source[32:40], source[0:8]]).view(torch.uint8)
    nixl_peer._check_landed(local, runs)
    swapped = torch.cat([source[0:8], source[32:40]]).view(torch.uint8)
    with pytest.raises(RuntimeError, match="did not land"):
        nixl_peer._check_landed(swapped, runs)


def test_ratio_is_nixl_time_over_pull_time():
    nixl = [2.0, 4.0, 3.0]  # median 3
    assert nixl_peer.x_nixl(nixl, [1.0, 2.0, 1.5]) == pytest.approx(2.0)
    data = nixl_peer.case_json(nixl, {"fast path": [1.0], "tcp": [6.0]})
    assert data["median"] == 3.0 and data["runs"] == (2.0, 4.0, 3.0)
    assert data["x_nixl_by_mode"] == {"fast path": 3.0, "tcp": 0.5}
    line = nixl_peer.ratio_line("batch", nixl, {"fast path": [1.0], "tcp": [6.0]})
    assert line.endswith("fast path 3.00, tcp 0.50")


def test_table_row_gives_rate_spread_and_memcpy_ratio():
    row = nixl_peer.table_row("single 1 MiB", 2_000_000_000, [1.0, 2.0, 0.5], memcpy_median=0.5)
    assert row == ["single 1 MiB", "NIXL UCX READ", "2.00", "1.00-4.00", "0.50", "-"]
    label = nixl_peer.PER_READ_LABEL
    row = nixl_peer.table_row("single 1 MiB", 2_000_000_000, [1.0], 0.5, label)
    assert row[1] == "NIXL UCX READ, descriptors per read"
    line = nixl_peer.ratio_line("batch", [2.0], {"tcp": [1.0]}, label)
    assert line.startswith("x NIXL UCX READ, descriptors per read (batch;")


def test_measure_refuses_runs_past_the_arena_before_starting_anything():
    with pytest.raises(ValueError, match="past the 64-byte arena"):
        nixl_peer.measure([("x", [(0, 8)]), ("y", [(60, 8)])], 64, 2, 5.0)


def test_measure_without_nixl_says_why_and_returns_none(monkeypatch, capsys):
    monkeypatch.setattr(nixl_peer, "find_nixl", lambda: None)
    assert nixl_peer.measure([("x", [(0, 8)])], 64, 2, 5.0) is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "NIXL peer: skipped" in out


def test_measure_with_a_broken_nixl_says_why_without_a_traceback(monkeypatch, capfd):
    # Both spawned processes import this module in place of NIXL and fail on
    # its missing API; the bench goes on with one line.
    monkeypatch.setattr(nixl_peer, "find_nixl", lambda: "json")
    assert nixl_peer.measure([("x", [(0, 8)])], 64, 2, 5.0) is None
    out, err = capfd.readouterr()
    assert out.startswith("NIXL peer: skipped (") and "AttributeError" in out
    assert "Traceback" not in err


@needs_nixl
def test_nixl_reads_the_same_runs_between_two_processes():
    cases = [("single", [(0, 1 << 20)]), ("batch", [(3 << 16, 1 << 16), (1 << 16, 1 << 16)])]
    # The reader checks every run landed at its packed place (None otherwise).
    times = nixl_peer.measure(cases, 4 << 20, runs=3, timeout=30.0)
    assert times is not None
    assert set(times) == {"single", "batch"}
    for prepared, per_read in times.values():
        assert len(prepared) == len(per_read) == 3
        assert min(prepared) > 0 and min(per_read) > 0


@needs_nixl
def test_bench_transfer_has_nixl_rows_and_ratios(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    args = ["bench", "transfer", "--arena-mib", "4", "--sizes-mib", "1", "--batch", "16"]
    args += ["--runs", "2", "--rounds", "1", "--modes", "fast path", "--no-perftest"]
    args += ["--json", str(out)]
    main(args)
    printed = capsys.readouterr().out
    assert printed.count("NIXL UCX READ  ") == 3  # one table row per case
    assert printed.count("NIXL UCX READ, descriptors per read  ") == 3
    assert "x NIXL UCX READ (batch 16 x 64 KiB;" in printed
    assert "x NIXL UCX READ, descriptors per read (batch 16 x 64 KiB;" in printed
    for result in json.loads(out.read_text())["results"]:
        assert len(result["nixl_ucx_read"]["runs"]) == 2
        assert result["nixl_ucx_read"]["x_nixl_by_mode"]["fast path"] > 0
        per_read = result["nixl_ucx_read_descriptors_per_read"]
        assert len(per_read["runs"]) == len(result["nixl_ucx_read"]["runs"])
        assert per_read["x_nixl_by_mode"]["fast path"] > 0


def test_bench_transfer_without_nixl_has_no_nixl_rows(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    args = ["bench", "transfer", "--arena-mib", "4", "--sizes-mib", "1", "--batch", "4"]
    args += ["--runs", "1", "--modes", "fast path", "--no-perftest", "--no-nixl"]
    main([*args, "--json", str(out)])
    assert "NIXL" not in capsys.readouterr().out
    assert all("nixl_ucx_read" not in r for r in json.loads(out.read_text())["results"])
