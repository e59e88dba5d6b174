"""The OpenAPI document tells the truth: schemathesis's checks (all of the
built-in ones) on schema-valid and schema-violating requests, with and
without the cluster token, against the real app under uvicorn with fake
workers. Each operation gets a fresh control, so the nodes that one
operation's random bodies register cannot break another's requests."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

from kvrelay.control.app import ControlConfig, create_app
from kvrelay.model.tokenizer_files import write_tokenizer
from tests.control.conftest import AUTH

OPERATIONS = [
    (method.upper(), path, bool(spec.get("parameters") or spec.get("requestBody")))
    for path, item in create_app(ControlConfig(token="t")).openapi()["paths"].items()
    for method, spec in item.items()
]
EXAMPLES = 10  # per operation, mode and token setting: the suite's run stays short


def check(operation, mode: GenerationMode, headers: dict) -> None:
    @given(operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def run(case):
        # A generous timeout: the shared machine runs at a load of 20 and more.
        case.call_and_validate(headers=headers, timeout=60)

    run()


@pytest.mark.parametrize(("method", "path", "has_inputs"), OPERATIONS)
def test_openapi_tells_the_truth(cluster, tmp_path, method, path, has_inputs):
    # Slow heartbeats (expiry after 15 min): neither the fake workers (their
    # heartbeats can time out at a load of 20) nor a node registered by a
    # generated body expire during the run; a vocabulary of 2^31 makes every token id in the
    # schema's range valid for the served model; make-model's tokenizer and
    # chat template serve text and chat.
    write_tokenizer(tmp_path, 256)
    control = cluster.control(heartbeat_s=300.0, request_timeout_s=120.0)
    for role in ("prefill", "decode"):
        cluster.worker(role, vocab=1 << 31, batch=4096, model_dir=str(tmp_path))
    operation = schemathesis.openapi.from_url(f"{control.url}/openapi.json")[path][method]
    modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * has_inputs
    for mode in modes:
        for headers in (AUTH, {}):
            check(operation, mode, headers)
