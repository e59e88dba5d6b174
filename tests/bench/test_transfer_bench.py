import json

from kvrelay.cli import main


def test_bench_transfer_writes_a_table_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # its calibration, not the user's
    out = tmp_path / "transfer.json"
    args = ["bench", "transfer", "--arena-mib", "4", "--sizes-mib", "1", "--batch", "16"]
    args += ["--runs", "1", "--rounds", "2", "--modes", "tcp,fast path", "--no-perftest"]
    args += ["--no-nixl"]
    args += ["--json", str(out)]
    main(args)
    printed = capsys.readouterr().out
    assert "median of 2 runs" in printed
    assert "x memcpy" in printed and "process_vm_readv of the runs, 1 call" in printed
    # Host facts, the load and the fast path's calibration are printed and kept.
    assert "load average:" in printed and "shmem huge pages" in printed
    assert "fast path copy (measured" in printed
    data = json.loads(out.read_text())
    cases = ["single 1 MiB", "batch 16 x 64 KiB", "batch 16 x 64 KiB, one run"]
    assert [r["case"] for r in data["results"]] == cases
    for result in data["results"]:
        assert set(result["modes"]) == {"tcp", "fast path"}
        # One timed pull per round, the rounds pooled.
        assert all(len(s["runs"]) == 2 for s in result["modes"].values())
        # The tcp backend's baseline: a plain loopback stream of the same bytes.
        assert result["tcp_stream"]["median"] > 0
        assert result["process_vm_readv_of_runs_one_call"]["median"] > 0
        assert all(s["first_pull_s"] > 0 for s in result["modes"].values())
    assert data["host"]["kernel"] and data["copy_plan"]["source"] == "measured"
    batch = data["goals"]["cases"]["batch 16 x 64 KiB"]
    assert batch["tcp_gb_per_s"] > 0  # checked against the goal without NIXL too


def test_tcp_stream_baseline_moves_the_senders_written_bytes():
    # An untouched sender buffer would be the kernel's zero page (always in
    # the cache): the baseline writes it and checks what lands, else raises.
    from kvrelay.bench.tcp_stream import tcp_stream

    summary = tcp_stream(1 << 20, runs=2)
    assert len(summary.runs) == 2 and summary.median > 0
