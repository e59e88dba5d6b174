"""`kvrelay bench cp`: CP=1 and CP=2 prefill side by side in one run (a tiny
model; the figures themselves are not asserted, only that they are measured)."""

import json

from kvrelay.cli import main


def test_bench_cp_reports_both_degrees(tmp_path, capsys):
    out = tmp_path / "cp.json"
    main(["bench", "cp", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
          "--vocab", "256", "--prompt-tokens", "96", "--page-size", "16", "--runs", "2",
          "--json", str(out)])  # fmt: skip
    table = capsys.readouterr().out
    assert "x CP=1" in table and "load average" in table
    data = json.loads(out.read_text())
    assert data["benchmark"] == "cp" and data["prompt_tokens"] == 96
    assert set(data["cp"]) == {"1", "2"}
    for degree in data["cp"].values():
        assert len(degree["prefill_s"]["runs"]) == 2 and degree["prefill_s"]["min"] > 0
    assert data["cp"]["1"]["speedup"]["runs"] == [1.0, 1.0]
