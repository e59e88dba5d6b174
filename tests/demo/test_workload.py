import argparse

import pytest

from kvrelay.demo import phases, profiles
from kvrelay.demo.cluster import PoolConfig
from kvrelay.demo.command import add_arguments, compare_tokens, optimum_by_turn
from kvrelay.demo.replay import TurnRecord, sample_turns
from kvrelay.demo.report import summarize, table
from kvrelay.demo.workload import Session, WorkloadConfig, optimum_hit_tokens

SMALL = WorkloadConfig(sessions=3, turns=3, system_tokens=40, user_tokens=8, tool_tokens=20,
                       answer_tokens=4)  # fmt: skip


def test_sessions_share_the_system_prompt_and_resend_their_conversation():
    a, b = Session(0, SMALL), Session(1, SMALL)
    assert a.prompt()[:40] == b.prompt()[:40]
    assert a.prompt()[40:] != b.prompt()[40:]
    first = a.prompt()
    a.answered([1, 2, 3, 4])
    second = a.prompt()
    assert second[: len(first)] == first
    assert second[len(first) : len(first) + 4] == [1, 2, 3, 4]
    assert len(second) == len(first) + 4 + SMALL.tool_tokens
    # Same seed, same tool output; another seed, other tokens.
    again = Session(0, SMALL)
    again.answered([1, 2, 3, 4])
    assert again.prompt() == second
    other = Session(0, WorkloadConfig(**{**_fields(SMALL), "seed": 1}))
    assert other.prompt() != Session(0, SMALL).prompt()
    assert all(0 <= t < 256 for t in second)


def _fields(config):
    return {name: getattr(config, name) for name in config.__slots__}


def test_final_context_and_validation():
    assert SMALL.final_context() == 40 + 8 + 2 * 24
    with pytest.raises(ValueError, match="turns"):
        WorkloadConfig(turns=0)


def test_optimum_counts_full_pages_seen_before_short_of_the_last_token():
    ps = 4
    first = list(range(10))  # pages [0..3], [4..7] full; 8, 9 partial
    answer = [50, 51, 52]
    second = first + answer + [60, 61, 62, 63, 64]  # 18 tokens
    hits = optimum_hit_tokens([(first, answer), (second, [7])], ps)
    # First request: nothing seen. Second: first + answer[:-1] = 12 tokens have KV,
    # three full pages; the prompt's last token is computed (17 // 4 = 4 usable).
    assert hits == [0, 12]
    # A prompt that is exactly what was seen still computes its last token.
    hits = optimum_hit_tokens([(first, answer), (first[:8], [1])], ps)
    assert hits == [0, 4]


def test_optimum_by_turn_replays_the_answers_turn_by_turn():
    records = [TurnRecord(s, t, 0, tokens=[s, t, 0, 1]) for s in range(3) for t in range(3)]
    optimum = optimum_by_turn(SMALL, records, page_size=8)
    assert set(optimum) == {(s, t) for s in range(3) for t in range(3)}
    # Session 0 turn 0 sees nothing; sessions 1 and 2 hit the 40-token system
    # prompt (5 pages of 8); later turns hit their previous context.
    assert optimum[(0, 0)] == 0
    assert optimum[(1, 0)] == optimum[(2, 0)] == 40
    assert optimum[(0, 1)] == 48  # 48 prompt + 3 answer tokens with KV: 6 full pages


def test_pool_config_parse():
    assert PoolConfig.parse("2xtp2") == PoolConfig(workers=2, tp=2, pp=1)
    assert PoolConfig.parse("1xtp1pp2") == PoolConfig(workers=1, tp=1, pp=2)
    assert PoolConfig.parse("tp=2,pp=2,workers=3") == PoolConfig(workers=3, tp=2, pp=2)
    assert PoolConfig.parse("3") == PoolConfig(workers=3)
    with pytest.raises(ValueError):
        PoolConfig.parse("tp0")
    with pytest.raises(ValueError):
        PoolConfig.parse("banana")


def test_compare_tokens_and_table():
    same = [TurnRecord(0, 0, 10, tokens=[1, 2])]
    other = [TurnRecord(0, 0, 10, tokens=[1, 3])]
    assert compare_tokens({"shared": same, "none": list(same)}) == []
    assert compare_tokens({"shared": other, "none": same}) == ["none vs shared: session 0 turn 1"]
    # A sampled mode is compared on its own turns only.
    two = [*same, TurnRecord(0, 1, 12, tokens=[4])]
    assert compare_tokens({"shared": two, "none": same}, sampled={"none"}) == []
    assert compare_tokens({"shared": two, "none": same}) == ["none vs shared: session 0 turn 2"]
    shared = [TurnRecord(0, t, 100, tokens=[1], ttft_s=0.1, cached_tier=80) for t in range(2)]
    none = [TurnRecord(0, t, 100, tokens=[1], ttft_s=1.0) for t in range(2)]
    optimum = {(0, 0): 0, (0, 1): 90}
    rows = [summarize("shared", shared, optimum, 1, 2.0), summarize("none", none, optimum, 1, 4.0)]
    assert rows[0].hit_rate == pytest.approx(0.8)
    assert rows[0].optimum == pytest.approx(0.45)
    assert rows[0].after_redeploy_hit == pytest.approx(0.8)
    text = table(rows)
    assert "shared tier" in text and "no cache" in text
    assert "10.0x" in text  # p50 TTFT 1.0 s vs 0.1 s


def test_long_profile_fills_only_unset_flags_and_sizes_pools_in_contexts():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = profiles.resolve(parser.parse_args(["--profile", "long", "--turns", "5"]))
    assert (args.turns, args.sessions, args.tool_tokens) == (5, 3, 24560)
    assert args.system_tokens + args.user_tokens == 32768
    assert profiles.MODELS["long"]["max_positions"] > 1 << 20
    full = WorkloadConfig(sessions=3, turns=8, system_tokens=30720, user_tokens=2048,
                          tool_tokens=24560, answer_tokens=16)  # fmt: skip
    assert full.final_context() == 204_800  # the profile's 32K -> 200K
    # 1.5 contexts of 100 pages (+1 for the answer's page): 151 pages.
    assert profiles.pool_pages(1.5, 100 * 64 - 16, 16, 64) == 151
    assert profiles.pool_pages(0.5, 6400, 16, 64) == 103  # never below one context
    default = profiles.resolve(parser.parse_args([]))
    assert (default.turns, default.prefill_pages, default.slow_prefill_s) == (16, 1024, 0.0)


def test_sample_turns_and_phase_breakdown():
    assert sample_turns(SMALL, 3) == [(0, 0), (1, 1), (2, 2)]
    assert sample_turns(SMALL, 1) == [(0, 2)] and sample_turns(SMALL, 0) == []
    record = TurnRecord(0, 0, 100, tokens=[1], ttft_s=2.0, control_ttft_s=1.75,
                        decode_first_s=0.5,
                        prefill_timings={"queue_s": 0.25, "compute_s": 1.0})  # fmt: skip
    got = phases.record_phases(record)
    assert got["control"] == 0.5 and got["first_token"] == 0.25 and got["decode_pull"] == 0.5
    assert sum(got[name] for name in phases.PHASES) == pytest.approx(2.0)
    assert phases.breakdown([record, record])["compute"] == 1.0
    assert "decode pull*" in phases.table({"shared": got}, {})
