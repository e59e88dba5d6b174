import json

from kvrelay.cli import main


def test_bench_transfer_writes_a_table_and_json(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    args = ["bench", "transfer", "--arena-mib", "4", "--sizes-mib", "1", "--batch", "16"]
    args += ["--runs", "2", "--modes", "tcp,fast path", "--no-perftest", "--json", str(out)]
    main(args)
    assert "x memcpy" in capsys.readouterr().out
    data = json.loads(out.read_text())
    cases = ["single 1 MiB", "batch 16 x 64 KiB", "batch 16 x 64 KiB, one run"]
    assert [r["case"] for r in data["results"]] == cases
    for result in data["results"]:
        assert set(result["modes"]) == {"tcp", "fast path"}
        assert all(len(s["runs"]) == 2 for s in result["modes"].values())
        # The tcp backend's baseline: a plain loopback stream of the same bytes.
        assert result["tcp_stream"]["median"] > 0
