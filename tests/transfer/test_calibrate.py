"""The fast path's copy calibration: what it measures, caches and reports."""

import json

import numpy as np
import pytest

from kvrelay.transfer import calibrate, create_agent
from kvrelay.transfer.calibrate import CopyChoice, CopyPlan


def test_measure_times_every_candidate_and_keeps_the_fastest(monkeypatch):
    monkeypatch.setattr(calibrate, "_SHAPE_BYTES", 1 << 20)  # lean: 16 runs a copy
    plan = calibrate.measure(rounds=1)
    labels = {c.label for c in calibrate.candidates(plan.host["cpus"])}
    for shape, choice in (("scattered", plan.scattered), ("contiguous", plan.contiguous)):
        rates = plan.measured[shape]
        assert set(rates) == labels and all(r > 0 for r in rates.values())
        single = max(r for c, r in rates.items() if "1 thread" in c)
        if choice.threads == 1:
            assert rates[choice.label] == single
        else:  # a second thread must win clearly
            assert rates[choice.label] > calibrate.TWO_THREAD_MARGIN * single
    assert plan.source == "measured" and plan.seconds > 0
    assert plan.host["kernel"] and plan.host["thp_shmem_enabled"]


def test_plan_chooses_by_the_batch_shape_and_round_trips_as_json():
    scattered, contiguous = CopyChoice("readv", 2), CopyChoice("map", 1, stream=True)
    plan = CopyPlan(scattered, contiguous, {"scattered": {}}, {"kernel": "k"})
    assert plan.choose(512 * 65536, 512) == scattered
    assert plan.choose(16 << 20, 1) == contiguous
    again = CopyPlan.from_json(json.loads(json.dumps(plan.to_json())), "cache")
    assert (again.scattered, again.contiguous, again.source) == (scattered, contiguous, "cache")
    assert again.to_json()["scattered"]["label"] == "readv, 2 threads"


def test_two_threads_are_chosen_only_when_clearly_faster():
    choices = [CopyChoice("map", 1), CopyChoice("map", 1, stream=True), CopyChoice("map", 2)]
    rates = {"map, plain, 1 thread": 5.0, "map, stream, 1 thread": 6.0}
    close = calibrate.pick(choices, rates | {"map, plain, 2 threads": 6.5})
    clear = calibrate.pick(choices, rates | {"map, plain, 2 threads": 7.5})
    assert close == CopyChoice("map", 1, stream=True) and clear == CopyChoice("map", 2)


def test_a_batch_landing_on_a_few_lines_gets_plain_stores_and_one_thread():
    from types import SimpleNamespace

    from kvrelay.transfer.fastpath import copy_job, destination_span
    from kvrelay.transfer.handle import ArenaInfo

    streaming = CopyChoice("map", 2, stream=True, prefetch=True)
    plan = CopyPlan(streaming, streaming, {}, {})
    peer = SimpleNamespace(mappings={1: SimpleNamespace(address=1 << 40)})
    info = ArenaInfo(1, 0, 1 << 30, b"", "")
    local = SimpleNamespace(address=1 << 41)
    # (remote, local, length): ucx_perftest's pattern, one run read 512 times into one place
    again = np.array([[0, 0, 65536]] * 512, dtype=np.uint64)
    spread = np.array([[i * 131072, i * 65536, 65536] for i in range(512)], dtype=np.uint64)
    assert destination_span(again[:, [1, 0, 2]]) == 65536
    small = copy_job(peer, info, local, again, True, 512 * 65536, plan).args[0]
    large = copy_job(peer, info, local, spread, True, 512 * 65536, plan).args[0]
    assert (small.stream, small.threads) == (False, 1)
    assert (large.stream, large.threads) == (True, 2)


def test_calibration_is_cached_per_boot(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    fixed = CopyPlan(CopyChoice("map", 1), CopyChoice("readv", 1), {}, {"kernel": "k"})
    monkeypatch.setattr(calibrate, "measure", lambda: calls.append(1) or fixed)
    first = calibrate.calibrate()
    second = calibrate.calibrate()
    assert calls == [1] and first.source == "measured" and second.source == "cache"
    assert second.contiguous == CopyChoice("readv", 1)
    assert calibrate.cache_path().is_relative_to(tmp_path)
    calibrate.calibrate(fresh=True)
    assert calls == [1, 1]


@pytest.mark.asyncio
async def test_an_unknown_fast_copy_is_refused():
    with pytest.raises(ValueError, match="fast_copy"):
        await create_agent("tcp", token="t", fast_copy="fastest")


def test_host_warnings_name_what_is_missing():
    facts = {"thp_shmem_enabled": "never", "thp_enabled": "madvise"}
    (warning,) = calibrate.host_warnings(facts)
    assert "shmem_enabled = never" in warning
    assert calibrate.host_warnings({"thp_shmem_enabled": "advise", "thp_enabled": "never"})
