import json

from kvrelay.cli import main


def write_trace(path, requests: int = 60) -> None:
    # Ten conversations, each request extending its conversation's prefix by
    # two blocks: requests of one conversation land on different workers.
    lines = []
    for r in range(requests):
        conv, turn = r % 10, r // 10
        ids = [conv * 1000 + i for i in range(2 + 2 * turn)]
        lines.append(json.dumps({"timestamp": r, "input_length": 512 * len(ids) - 100,
                                 "output_length": 4, "hash_ids": ids}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def test_bench_cache_replays_and_reports(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    out, png = tmp_path / "out.json", tmp_path / "hit.png"
    main(["bench", "cache", "--trace", str(trace), "--workers", "4", "--servers", "2",
          "--capacities", "8,400", "--json", str(out), "--plot", str(png),
          "--no-progress"])  # fmt: skip
    payload = json.loads(out.read_text())
    infinite = payload["infinite"]["block_hit_rate"]
    # Turn t reuses the 2t blocks of turn t-1: sum over turns of 2t / (2 + 2t).
    expected = sum(2 * t for t in range(6)) / sum(2 + 2 * t for t in range(6))
    assert abs(infinite - expected) < 1e-9
    small, large = payload["capacities"]
    # Capacity covering the working set: the shared tier is the optimum.
    assert large["shared"]["block_hit_rate"] >= 0.97 * infinite
    # Round robin over 4 workers sends conversation c's turn t to worker
    # (c + 2t) % 4: a local cache only has turn t-2's 2t-2 blocks.
    local = sum(2 * t - 2 for t in range(2, 6)) / sum(2 + 2 * t for t in range(6))
    assert abs(large["local"]["block_hit_rate"] - local) < 1e-9
    assert small["shared"]["block_hit_rate"] < large["shared"]["block_hit_rate"]
    assert large["shared"]["token_hit_rate"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "shared/inf" in capsys.readouterr().out
