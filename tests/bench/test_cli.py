import json
import subprocess
import sys

from kvrelay.cli import main


def test_bench_layout_writes_ratios_to_memcpy(tmp_path, capsys):
    out = tmp_path / "layout.json"
    main(
        [
            "bench",
            "layout",
            "--tokens",
            "300",
            "--layers",
            "3",
            "--kv-heads",
            "4",
            "--head-dim",
            "16",
            "--page-size",
            "16",
            "--engine-page-size",
            "8",
            "--tp",
            "2",
            "--runs",
            "2",
            "--threads",
            "1,2",
            "--json",
            str(out),
        ]
    )
    table = capsys.readouterr().out
    assert "x memcpy" in table and "TP=2 rank 0" in table
    data = json.loads(out.read_text())
    assert data["benchmark"] == "layout"
    assert [(r["case"], r["threads"]) for r in data["results"]] == [
        ("full (TP=1)", 1),
        ("full (TP=1)", 2),
        ("TP=2 rank 0", 1),
        ("TP=2 rank 0", 2),
    ]
    for result in data["results"]:
        for key in ("gather_vs_memcpy", "scatter_vs_memcpy", "memcpy", "gather", "scatter"):
            summary = result[key]
            assert len(summary["runs"]) == 2
            assert summary["min"] <= summary["median"] <= summary["max"]
            assert summary["median"] > 0
    full, tp = data["results"][0]["bytes"], data["results"][2]["bytes"]
    assert full == 2 * tp  # a TP=2 rank moves half of every page


def test_info_reports_the_backend():
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "info"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    info = json.loads(out.stdout)
    assert info["page_copy_backend"] in ("cpp", "numba")
    assert "torch" in info
    # The fast path's copy calibration (measured or cached) and the host facts.
    plan = info["fast_path_copy"]
    assert plan["scattered"]["method"] in ("map", "readv") and plan["host"]["kernel"]
    # What large pulls are split over, from the same calibration.
    stripes = info["pull_stripes"]
    assert stripes["min_bytes"] == 8 << 20
    assert stripes["ucx_same_host_workers"] in (1, 2) and stripes["tcp_connections"] in (1, 2)
    ratios = stripes["kernel_copy_two_threads_x_one"]
    measured = plan["measured_gb_per_s"]
    for shape, ratio in ratios.items():
        rates = measured[shape]
        assert ratio == round(rates["readv, 2 threads"] / rates["readv, 1 thread"], 2)
