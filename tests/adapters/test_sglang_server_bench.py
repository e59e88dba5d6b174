"""`kvrelay bench sglang-server` end to end with tiny sizes and a redeploy from
TP=2 to TP=1: kvrelay's pages are read by the TP=1 servers, SGLang's file
L3 (keyed by TP rank and size) holds none that TP=1 reads. (Mooncake's
modes: test_sglang_mooncake.py, which `make test-peers` runs.)"""

from __future__ import annotations

import json
import subprocess
import sys

SIZES = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
         "--sessions", "2", "--system-tokens", "256", "--user-tokens", "32",
         "--tool-tokens", "32", "--answer-tokens", "4", "--device-tokens", "2048",
         "--settle-s", "1", "--gap-s", "0.1", "--mooncake-segment-gb", "0.25",
         "--turns", "1", "--redeploy-turns", "1", "--tp", "2", "--redeploy-tp", "1"]  # fmt: skip


def bench_redeploy(tmp_path, modes: list[str]) -> dict:
    """The bench's JSON `redeploy` part, checked for what every mode shares."""
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "kvrelay.cli", "bench", "sglang-server", *SIZES,
               "--modes", ",".join(modes), "--out", str(tmp_path / "logs"),
               "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == set(modes)
    assert result["outputs_equal"], result["outputs_differ"]
    for mode in modes:  # before the redeploy the shared system prompt hits in the device pool
        assert result["modes"][mode]["storage_hit_rate"] == 0.0
        assert result["modes"][mode]["hit_rate"] > 0.0
    after = result["redeploy"]
    assert after["tp"] == 1 and after["turns"] == 1
    assert after["outputs_equal"], after["outputs_differ"]
    for mode in modes:
        assert after[mode]["ttft_p50_s"] > 0 and after[mode]["requests"] == 2
    return after


def test_after_a_tp_redeploy_kvrelay_serves_the_pages_and_the_file_l3_misses(tmp_path):
    after = bench_redeploy(tmp_path, ["kvrelay", "file"])
    assert after["kvrelay"]["x_optimum"] >= 0.95
    assert after["kvrelay"]["first_turn_hit_rate"] == after["kvrelay"]["storage_hit_rate"] > 0.5
    # The first TP=1 request computes all; the second reads the system prompt it wrote
    assert after["file"]["x_optimum"] < 0.5
    assert after["l3_held"]["file"]["after"] == after["l3_held"]["file"]["before"] > 0
