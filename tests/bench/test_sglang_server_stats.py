"""`kvrelay bench sglang-server`'s numbers: the request-by-request comparison of
two modes, the request order, and each phase's report (before and after a
redeploy) from the requests the modes served."""

from __future__ import annotations

import itertools
from argparse import Namespace
from collections import Counter
from dataclasses import dataclass

import pytest

from kvrelay.bench.sglang_server import assemble, request_order
from kvrelay.bench.sglang_server_report import Served, paired, phase, reference_mode
from kvrelay.demo.workload import optimum_hit_tokens

PAGE = 4


def test_paired_compares_the_same_requests_of_two_modes():
    results = {"kvrelay": {"ttfts_s": [1.0, 2.0, 3.0, 4.0]},
               "file": {"ttfts_s": [2.0, 2.0, 2.0, 2.0]}}  # fmt: skip
    pair = paired(results, "kvrelay", "file")
    assert pair["median_ratio"] == pytest.approx(1.25)
    assert pair["faster"] == 1 and pair["requests"] == 4
    assert pair["p25_ratio"] <= pair["median_ratio"] <= pair["p75_ratio"]
    assert paired({"kvrelay": results["kvrelay"]}, "kvrelay", "file") is None


def test_paired_refuses_runs_of_different_lengths():
    with pytest.raises(ValueError):
        paired({"a": {"ttfts_s": [1.0]}, "b": {"ttfts_s": [1.0, 2.0]}}, "a", "b")


def test_request_order_balances_places_and_predecessors():
    modes = ["kvrelay", "file", "none"]
    orders = [request_order(modes, j) for j in range(2 * len(modes))]
    assert all(sorted(o) == sorted(modes) for o in orders)
    places = Counter((m, o.index(m)) for o in orders for m in o)
    assert set(places.values()) == {2}  # every mode in every place twice
    follows = Counter(pair for o in orders for pair in itertools.pairwise(o))
    assert len(follows) == 6 and set(follows.values()) == {2}  # each after each other


@dataclass
class Reply:
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    storage_tokens: int
    ttft_s: float


def _session(cached: list[int], answers: list[list[int]] | None = None) -> list[Served]:
    """One session of three turns (a 10-token prompt growing by its 2-token
    answer and 2 tool tokens), turn t's reply with cached[t] tokens cached."""
    answers = answers or [[7, 7], [8, 8], [9, 9]]
    prompt, served = list(range(10)), []
    for turn, hit in enumerate(cached):
        reply = Reply(answers[turn], len(prompt), hit, hit, 0.1 * (turn + 1))
        served.append(Served(turn, list(prompt), reply, 1.0))
        prompt += answers[turn] + [50 + turn, 60 + turn]
    return served


def test_phase_reports_each_mode_against_its_optimum_and_the_reference():
    # Prompts of 10, 14, 18 tokens; an infinite cache of 4-token pages serves
    # 0, 8 and 12 (a page with the last answer token is not whole; the last
    # prompt token is computed).
    requests = {"none": _session([0, 0, 0]), "kvrelay": _session([0, 8, 12]),
                "mooncake": _session([0, 0, 12], answers=[[7, 7], [8, 8], [5, 5]])}  # fmt: skip
    assert optimum_hit_tokens([(s.prompt, s.reply.output_ids) for s in requests["none"]],
                              PAGE) == [0, 8, 12]  # fmt: skip
    after = phase(requests, range(1, 3), PAGE, reference_mode(list(requests)))
    assert after["optimum"] == pytest.approx(20 / 32)
    kvrelay, mooncake = after["modes"]["kvrelay"], after["modes"]["mooncake"]
    assert kvrelay["hit_rate"] == pytest.approx(20 / 32) and kvrelay["x_optimum"] == 1.0
    assert kvrelay["first_turn_hit_rate"] == pytest.approx(8 / 14)
    assert kvrelay["requests"] == 2 and kvrelay["serving_s"] == 2.0
    assert kvrelay["ttfts_s"] == pytest.approx([0.2, 0.3])
    assert kvrelay["ttft_p50_s"] == pytest.approx(0.25)
    assert mooncake["first_turn_hit_rate"] == 0.0
    assert mooncake["hit_rate"] == pytest.approx(12 / 32)
    # The reference generated other tokens in turn 2 only
    assert after["outputs_differ"] == ["mooncake"] and not after["outputs_equal"]
    before = phase(requests, range(0, 2), PAGE, "none")
    assert before["outputs_equal"] and before["outputs_differ"] == []
    assert before["modes"]["none"]["x_optimum"] == 0.0


def test_assemble_splits_the_json_at_the_redeploy(capsys):
    requests = {"kvrelay": _session([0, 8, 12]), "file": _session([0, 8, 0]),
                "none": _session([0, 0, 0])}  # fmt: skip
    args = Namespace(turns=2, redeploy_turns=1, redeploy_tp=1, redeploy_layout="layer_first",
                     tp=2, layout="layer_first", page_size=PAGE, sessions=1, system_tokens=8,
                     tool_tokens=2, device_tokens=64, host_ratio=1.5, flush="request",
                     restart_every=0)  # fmt: skip
    held = {"file": {"before": 6, "after": 6}}
    result = assemble(args, list(requests), requests, held)
    assert set(result["modes"]) == set(requests) and result["outputs_reference"] == "none"
    assert result["modes"]["file"]["requests"] == 2 and result["optimum"] == pytest.approx(8 / 24)
    assert result["modes"]["file"]["x_optimum"] == 1.0
    redeploy = result["redeploy"]
    assert redeploy["kvrelay"]["hit_rate"] == pytest.approx(12 / 18)
    assert redeploy["file"]["hit_rate"] == 0.0 and redeploy["kvrelay"]["x_optimum"] == 1.0
    assert redeploy["outputs_equal"] and redeploy["l3_held"] == held
    assert redeploy["tp"] == 1 and redeploy["turns"] == 1
    assert result["kvrelay_over_file"]["requests"] == 2
    out = capsys.readouterr().out
    assert "then 1 turns on TP=1" in out and "after" in out
    args.redeploy_turns = 0
    assert assemble(args, list(requests), requests, {})["redeploy"] is None
