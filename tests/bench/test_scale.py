"""`kvrelay bench scale` on tiny contexts: every phase timed, the floor beside
it, the JSON and the plot written (no timing assertions)."""

import json

import pytest

from kvrelay.bench.scale import PHASES
from kvrelay.cli import main


def test_bench_scale_reports_phases_and_the_floor(tmp_path, capsys):
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    main(["bench", "scale", "--contexts", "512,1024", "--new-tokens", "40", "--page-size", "16",
          "--max-prefill-tokens", "16", "--repeats", "2", "--json", str(out),
          "--plot", str(png)])  # fmt: skip
    table = capsys.readouterr().out
    assert "x_floor" in table and "load average" in table
    results = json.loads(out.read_text())["results"]
    assert [r["context"] for r in results] == [512, 1024]
    for r in results:
        assert set(r["phases_s"]) == set(PHASES)
        pairs = r["pairs"]
        assert [p["order"] for p in pairs] == ["tf", "ft"]  # interleaved A B B A
        for p in pairs:
            assert p["floor_s"] > 0 and p["x_floor"] == pytest.approx(p["total_s"] / p["floor_s"])
        ratios = sorted(p["x_floor"] for p in pairs)
        assert r["x_floor"] == pytest.approx(sum(ratios) / 2)  # the median of two
        assert r["x_floor_min"] == ratios[0] and r["x_floor_max"] == ratios[-1]
        assert r["pages"] == -(-(r["context"] + 40) // 16)
    assert png.stat().st_size > 1000


def test_bench_scale_refuses_bad_contexts():
    with pytest.raises(SystemExit, match="--contexts"):
        main(["bench", "scale", "--contexts", "huge"])
    with pytest.raises(SystemExit, match="--repeats"):
        main(["bench", "scale", "--contexts", "512", "--repeats", "0"])
