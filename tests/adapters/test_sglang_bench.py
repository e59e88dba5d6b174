"""`kvrelay bench sglang` end to end with tiny sizes: the CLI, the JSON, the byte check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvrelay.bench.sglang import ROWS, _Pages
from tests.adapters import sglang_env as env

PAGES, RUNS = 5, 2


def test_bench_sglang_writes_its_table_and_json(tmp_path):
    out = tmp_path / "sglang.json"
    sizes = ["--page-size", "4", "--layers", "2", "--heads", "2", "--head-dim", "8"]
    # --no-mooncake: the mooncake columns have a test of their own (test_sglang_mooncake.py)
    sizes += ["--batch", "2", "--servers", "1", "--no-mooncake"]
    command = [sys.executable, "-m", "kvrelay.cli", "bench", "sglang", "--pages", str(PAGES),
               *sizes, "--runs", str(RUNS), "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "load average" in done.stdout and "x HiCacheFile" in done.stdout
    assert "Mooncake Store left out: --no-mooncake" in done.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "sglang"
    assert result["peers"] == {"mooncake": {"skipped": "--no-mooncake"}}
    [size] = result["sizes"]
    assert size["page_bytes"] == 2 * 2 * 4 * 2 * 8 * 2
    assert size["byte_check"] == {
        "kvrelay_pages": PAGES * RUNS,
        "hicache_file_pages": PAGES * RUNS,
    }
    assert set(size["rows"]) == set(ROWS) and "mooncake" not in size
    for row, r in size["rows"].items():
        assert row in done.stdout
        for name in ("seconds", "pages_per_s", "gb_per_s", "x_hicache_file"):
            assert len(r[name]["runs"]) == RUNS and r[name]["min"] > 0
    assert size["rows"]["HiCacheFile get"]["x_hicache_file"]["median"] == 1.0
    for store in ("kvrelay", "file"):
        assert size[store]["set_gbps"] > 0 and size[store]["get_gbps"] > 0


def test_byte_check_fails_on_a_changed_byte():
    pool = env.mha_pool("page_first", heads=2, layers=2, start_layer=0, page_size=4,
                        head_dim=8, dtype=torch.bfloat16)  # fmt: skip
    pages = _Pages(pool, 3)
    pages.check("self")
    pool.kv_buffer[1, 2 * 4 + 1].view(torch.uint8).view(-1)[5] ^= 1  # page_first: kv, token, ...
    with pytest.raises(RuntimeError, match="page 2 has 1 wrong bytes"):
        pages.check("self")
