"""Control keys a prompt as the node that will serve it: a worker registered
with the "sglang" key scheme gets SGLang-chain keys (tier probe, hit estimate)."""

import pytest
from pydantic import ValidationError

from kvrelay.control.dispatch import Job
from kvrelay.control.registry import Registry
from kvrelay.control.schemas import NodeRegistration
from kvrelay.layout.keys import scheme_page_keys

NS = bytes(range(32))


@pytest.mark.parametrize("scheme", ["kvrelay", "sglang"])
def test_job_keys_follow_the_nodes_key_scheme(scheme):
    node = Registry(1.0).register(
        role="prefill", address="127.0.0.1:1", model="m", namespace=NS, page_size=4,
        vocab_size=300, tp=1, pp=1, num_pages=8, cache=False, key_scheme=scheme,
    )  # fmt: skip
    tokens = list(range(10))
    job = Job(rid="r", model="m", tokens=tokens, params={})
    want = scheme_page_keys(scheme, NS, tokens, 4)
    assert len(want) == 2
    assert job.page_keys(node) == want
    assert job.page_keys(node, tokens[:4]) == want[:1]
    longer = tokens + list(range(50, 57))  # the prompt and what was generated
    assert job.page_keys(node, longer) == scheme_page_keys(scheme, NS, longer, 4)
    assert node.describe()["key_scheme"] == scheme


def test_registration_refuses_an_unknown_key_scheme():
    body = {"role": "prefill", "address": "127.0.0.1:1", "model": "m", "namespace": NS.hex(),
            "page_size": 4, "vocab_size": 300, "num_pages": 8}  # fmt: skip
    assert NodeRegistration(**body).key_scheme == "kvrelay"
    with pytest.raises(ValidationError):
        NodeRegistration(**body, key_scheme="vllm")
