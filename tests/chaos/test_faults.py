"""A short randomised fault run against a real cluster (control, two cache
servers on a real Valkey/Redis L3, two prefill and two decode workers):
a few faults drawn at random, each injected at a random moment of a small
multi-session workload. Every request is correct (same tokens as one
process) or a clear error; none lost, hung or wrong; free counts come back;
the cluster keeps serving. The long run is `kvrelay bench chaos`."""

from __future__ import annotations

import os
import random
import signal

import pytest

from kvrelay.chaos import frames
from kvrelay.chaos.cluster import ChaosCluster, ChaosConfig
from kvrelay.chaos.faults import FaultRow, Faults, fault_round, settled_counts
from kvrelay.chaos.valkey import server_binary
from kvrelay.chaos.workload import Oracle, Workload
from tests.chaos.conftest import DTYPE, PAGE, run

SEED = int(os.environ.get("KVRELAY_CHAOS_SEED", random.randrange(1 << 16)))


@pytest.fixture(scope="module")
def cluster(chaos_model, tmp_path_factory):
    if server_binary() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no valkey-server or redis-server on PATH")
        pytest.skip("no valkey-server or redis-server on PATH")
    model_dir, page_bytes = chaos_model
    config = ChaosConfig(model_dir=model_dir, log_dir=tmp_path_factory.mktemp("faults"),
                         page_bytes=page_bytes, page_size=PAGE, dtype=DTYPE)  # fmt: skip
    cluster = ChaosCluster(config).start()
    yield cluster
    cluster.stop()


def test_random_faults_lose_nothing(cluster, chaos_model):
    rng = random.Random(SEED)
    faults = Faults(cluster, rng)
    oracle = Oracle(chaos_model[0], DTYPE, PAGE)
    workload = Workload(cluster.control_url, oracle, seed=SEED, deadline_s=30)
    chosen = ["kill_decode", *rng.sample([n for n in faults.names() if n != "kill_decode"], 2)]
    rows = []
    for name in chosen:
        row = FaultRow(name)
        run(fault_round(cluster, faults, workload, name, row, sessions=3, turns=2))
        rows.append(row.as_dict())
    for row in rows:
        assert row["lost"] == row["hung"] == row["wrong_tokens"] == 0, (SEED, row)
        assert row["leaked_pages"] == 0 and row["not_serving_after"] == 0, (SEED, row)
        assert row["completed_correct"] + row["failed_clear_error"] == row["requests"], row
    assert sum(r["completed_correct"] for r in rows) > 0, rows
    assert not any(cluster.unhandled_errors().values()), cluster.unhandled_errors()


def test_prefill_killed_after_publishing_handles(cluster):
    """Prefill answered (its handles name pages in its staging arena), then
    dies before decode pulls them: decode answers a typed error within its
    transfer deadline and its pool pages and staging rows all come back."""
    token = cluster.config.token
    victim = cluster.named("prefill")[0]
    decode = cluster.named("decode")[0]
    baseline = {decode.name: run(cluster.free_counts())[decode.name]}
    prompt = random.Random(SEED).choices(range(1, 256), k=3 * PAGE + 5)
    params = {"max_new_tokens": 6, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0,
              "stop_token_ids": []}  # fmt: skip
    request = {"op": "prefill", "rid": "p", "tokens": frames.tokens(prompt), "params": params,
               "lease_s": 30.0}  # fmt: skip
    answer = run(frames.call(victim.ready["address"], request, token))
    assert frames.accepted(answer) and answer["handles"], answer
    faults = Faults(cluster, random.Random(SEED))
    faults._victim = victim
    os.killpg(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait(10)
    message = {"op": "decode", "rid": "d", "tokens": frames.tokens(prompt), "params": params,
               "first_token": answer["first_token"], "tier_pages": 0, "pages": answer["pages"],
               "handles": answer["handles"]}  # fmt: skip
    reply = run(frames.call(decode.ready["address"], message, token, timeout=30))
    assert reply["op"] == "error" and reply["error"] == "PullFailed", reply
    assert run(settled_counts(cluster, baseline, timeout_s=20)) == 0
    faults.clear("kill_prefill")  # a new prefill on the cluster for the next test
