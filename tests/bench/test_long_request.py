"""`kvrelay bench long-request` at a small context: the context's KV seeded
into a real cluster's tier, one request through control, the tokens against
one process (the command exits 1 when they differ)."""

import json

import pytest

from kvrelay.cli import main


@pytest.mark.slow
def test_a_long_request_through_the_cluster_equals_one_process(tmp_path, capsys):
    out = tmp_path / "long.json"
    main(["bench", "long-request", "--context", "1024", "--new-tokens", "80", "--max-tokens", "3",
          "--page-size", "16", "--max-prefill-tokens", "32", "--out", str(tmp_path),
          "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())["result"]
    assert result["tokens_equal"] and len(result["tokens"]) == 3
    assert result["cached_tokens"] == {"local": 0, "tier": 1024}
    assert result["reference_cached"] == 1024
    assert "same tokens" in capsys.readouterr().out


@pytest.mark.slow
def test_a_computed_context_is_taken_from_the_tier_by_the_next_request(tmp_path, capsys):
    out = tmp_path / "computed.json"
    main(["bench", "long-request", "--computed", "--context", "1024", "--new-tokens", "80",
          "--max-tokens", "3", "--page-size", "16", "--max-prefill-tokens", "32",
          "--out", str(tmp_path), "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())["result"]
    assert result["computed"] and result["cold_cached_tokens"] == {"local": 0, "tier": 0}
    # The prefill pool was restarted: the whole context came from the tier.
    assert result["cached_tokens"] == {"local": 0, "tier": 1024}
    assert result["tokens_equal"] and result["reference_cached"] == 0
    assert "computed cold" in capsys.readouterr().out
