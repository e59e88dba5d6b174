"""Completions through real HTTP, a real uvicorn and fake workers: answers,
streaming, validation messages, auth."""

import pytest

from tests.control.conftest import AUTH
from tests.control.fakes import NAMESPACE, expected_answer
from tests.control.sse import parse_sse


@pytest.fixture
def served(cluster):
    control = cluster.control()
    prefill = cluster.worker("prefill")
    decode = cluster.worker("decode")
    return control, prefill, decode


def test_text_completion(served):
    control, prefill, decode = served
    reply = control.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    tokens = expected_answer(list(b"hello"), 5, 512)
    assert bytes(tokens) == b"pqrst"
    choice = body["choices"][0]
    assert choice["token_ids"] == tokens
    assert choice["text"] == bytes(tokens).decode()
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    assert body["kvrelay"]["prefill_node"] == prefill.node_id
    assert body["kvrelay"]["decode_node"] == decode.node_id
    assert body["kvrelay"]["ttft_s"] > 0
    # What the workers got: the prompt as bytes, the client's sampling params.
    sent = prefill.requests[0]
    assert sent["tokens"] == list(b"hello")
    assert sent["params"]["max_new_tokens"] == 5 and sent["params"]["temperature"] == 0
    handed = decode.requests[0]
    assert handed["rid"] == sent["rid"] == body["id"]
    assert handed["first_token"] == tokens[0]
    [handle] = handed["handles"]  # the typed message adds its optional fields
    assert (handle["handle"], handle["runs"]) == (b"H:" + sent["rid"].encode(), [[0, 16]])


def test_token_ids_prompt_with_stop_token(served):
    control, _, _ = served
    prompt = [300, 301, 302]
    reply = control.http.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 50, "stop_token_ids": [306], "model": "fake"},
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["token_ids"] == [303, 304, 305, 306]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == ""  # ids >= 256 carry no bytes


def test_first_token_finishing_skips_decode(served):
    control, prefill, decode = served
    reply = control.http.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 1})
    body = reply.json()
    assert body["choices"][0]["token_ids"] == [9]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["kvrelay"]["decode_node"] is None
    assert len(prefill.requests) == 1 and decode.requests == []


def test_streaming(served):
    control, _, _ = served
    with control.http.stream(
        "POST", "/v1/completions", json={"prompt": "ab", "max_tokens": 6, "stream": True}
    ) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(reply.read().decode())
    assert events[-1] == ("message", "[DONE]")
    chunks = [data for _, data in events[:-1]]
    # First token alone (TTFT), then the decode batches of two, then the end chunk.
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[99], [100, 101], [102, 103],
                                                              [104], []]  # fmt: skip
    assert "".join(c["choices"][0]["text"] for c in chunks) == "cdefgh"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_streaming_multibyte_text_is_whole():
    from kvrelay.control.tokenizer import StreamDecoder

    data = "é€".encode()
    decoder = StreamDecoder()
    assert decoder.feed(data[:1]) + decoder.feed(data[1:4]) + decoder.feed(data[4:]) == "é€"


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"prompt": ""}, 400, "prompt: Value error, prompt must not be empty"),
        ({"prompt": []}, 400, "prompt must not be empty"),
        ({"prompt": [1, 512]}, 400, "outside the vocabulary [0, 512)"),
        ({"prompt": [1, -1]}, 400, "must not be negative"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens: Input should be greater than"),
        ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens: Input should be less than"),
        ({"prompt": "x", "temperature": -0.5}, 400, "temperature: Input should be greater than"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p: Input should be greater than 0"),
        ({"prompt": "x", "top_p": 1.5}, 400, "top_p: Input should be less than or equal to 1"),
        ({"prompt": "x", "model": "nope"}, 404, "unknown model 'nope'; serving: fake"),
        ({"prompt": "x", "stop_token_ids": [9999]}, 400, "stop_token_ids has token ids outside"),
        ({"max_tokens": 3}, 400, "prompt: Field required"),
        ({"prompt": 5}, 400, "prompt: Input should be a valid"),
        ({"prompt": "x", "n": 3}, 400, "n: Value error, only one choice per request"),
        ({"prompt": "x", "best_of": 2}, 400, "best_of: Value error, only one choice"),
        ({"prompt": "x", "logprobs": 1}, 400, "logprobs: Value error, not supported"),
        ({"prompt": "x", "echo": True}, 400, "echo: Value error, echo is not supported"),
        ({"prompt": "x", "suffix": "z"}, 400, "suffix: Value error, not supported"),
        ({"prompt": "x", "presence_penalty": 1}, 400, "penalties are not supported"),
        ({"prompt": "x", "frequency_penalty": -1}, 400, "penalties are not supported"),
        ({"prompt": "x", "logit_bias": {"5": 1}}, 400, "logit_bias is not supported"),
        ({"prompt": "x", "stop": [""]}, 400, "stop.0: String should have at least 1"),
        ({"prompt": "x", "stop": list("abcde")}, 400, "stop: List should have at most 4"),
        ({"prompt": "x", "best_of_n": 2}, 400, "best_of_n: Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_bad_requests_say_what_is_wrong(served, body, status, message):
    control, prefill, _ = served
    reply = control.http.post("/v1/completions", json=body)
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]["message"]
    assert prefill.requests == []


def test_malformed_json_is_a_400(served):
    control, _, _ = served
    reply = control.http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400
    assert "JSON" in reply.json()["error"]["message"]


def test_text_prompt_needs_a_byte_vocabulary(cluster):
    control = cluster.control()
    cluster.worker("prefill", model="tiny", vocab=100)
    cluster.worker("decode", model="tiny", vocab=100)
    reply = control.http.post("/v1/completions", json={"prompt": "hi"})
    assert reply.status_code == 400
    assert "text prompts need a vocabulary of at least 256" in reply.json()["error"]["message"]
    reply = control.http.post("/v1/completions", json={"prompt": [98, 99], "max_tokens": 3})
    assert reply.json()["choices"][0]["token_ids"] == [0, 1, 2]  # wraps at vocab 100


def test_no_workers_is_503_with_reason(cluster):
    control = cluster.control()
    reply = control.http.post("/v1/completions", json={"prompt": "hi"})
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == "no workers are registered"


def test_models_and_health(served):
    control, _, _ = served
    models = control.http.get("/v1/models").json()["data"]
    assert [(m["id"], m["vocab_size"], m["workers"]) for m in models] == [
        ("fake", 512, {"prefill": 1, "decode": 1})
    ]
    assert models[0]["namespace"] == NAMESPACE.hex()
    health = control.http.get("/health").json()
    assert health == {"status": "ok", "live_nodes": {"prefill": 1, "decode": 1}, "ready": True}


REGISTRATION = {
    "role": "prefill",
    "address": "127.0.0.1:9",
    "model": "m",
    "namespace": "ab" * 32,
    "page_size": 4,
    "vocab_size": 10,
    "num_pages": 8,
}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("POST", "/v1/nodes", REGISTRATION), ("POST", "/admin/flush", {}),
     ("POST", "/admin/drain", {"node_id": "x"}), ("DELETE", "/v1/nodes/x", None),
     ("POST", "/v1/nodes/x/heartbeat", {})],
)  # fmt: skip
def test_registration_and_admin_need_the_token(cluster, method, path, body):
    control = cluster.control()
    none = control.http.request(method, path, json=body)
    assert none.status_code == 401 and none.json()["detail"] == "missing bearer token"
    wrong = control.http.request(method, path, json=body, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 403 and wrong.json()["detail"] == "wrong token"
    right = control.http.request(method, path, json=body, headers=AUTH)
    assert right.status_code in (200, 404), right.text
    assert control.registry.nodes == {} or path == "/v1/nodes"


@pytest.mark.parametrize(
    ("change", "message"),
    [({"role": "router"}, "role: Input should be 'prefill' or 'decode'"),
     ({"address": "nohost"}, "address: Value error, address must be host:port"),
     ({"namespace": "zz"}, "namespace: Value error, namespace must be 64 hex"),
     ({"page_size": 0}, "page_size: Input should be greater than or equal to 1"),
     ({"num_pages": "many"}, "num_pages: Input should be a valid integer")],
)  # fmt: skip
def test_bad_registration_is_400_with_reason(cluster, change, message):
    control = cluster.control()
    reply = control.http.post("/v1/nodes", json=REGISTRATION | change, headers=AUTH)
    assert reply.status_code == 400
    assert message in reply.json()["error"]["message"]


def test_off_values_of_unsupported_parameters_are_accepted(served):
    control, _, _ = served
    body = {"prompt": [1], "max_tokens": 2, "n": 1, "best_of": 1, "logprobs": None,
            "echo": False, "suffix": None, "presence_penalty": 0, "frequency_penalty": 0.0,
            "logit_bias": {}, "user": "u-1"}  # fmt: skip
    reply = control.http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == [2, 3]


def test_stop_string_cuts_the_text_and_ends_the_request(served):
    control, _, decode = served
    # Answer to "ab": c d e f g h ...; "ef" is the stop, spanning two decode batches.
    body = {"prompt": "ab", "max_tokens": 20, "stop": ["zz", "ef"]}
    reply = control.http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] == "cd"
    assert choice["finish_reason"] == "stop"
    assert bytes(choice["token_ids"]).startswith(b"cdef")
    assert reply.json()["kvrelay"]["decode_node"] == decode.node_id
    assert len(decode.requests) == 1


def test_stop_string_in_the_first_token(served):
    control, _, _ = served
    reply = control.http.post("/v1/completions", json={"prompt": "ab", "stop": "c"})
    choice = reply.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["token_ids"]) == ("", "stop", [99])


def test_stop_string_not_reached_is_plain_text(served):
    control, _, _ = served
    reply = control.http.post("/v1/completions",
                              json={"prompt": "ab", "max_tokens": 3, "stop": "ef"})  # fmt: skip
    choice = reply.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("cde", "length")  # "e" held, then let go


def test_streaming_stop_string_is_never_sent(served):
    control, _, _ = served
    with control.http.stream("POST", "/v1/completions",
                             json={"prompt": "ab", "max_tokens": 20, "stream": True,
                                   "stop": "fg"}) as reply:  # fmt: skip
        events = parse_sse(reply.read().decode())
    assert events[-1] == ("message", "[DONE]")
    chunks = [data["choices"][0] for _, data in events[:-1]]
    assert "".join(c["text"] for c in chunks) == "cde"
    assert chunks[-1]["finish_reason"] == "stop"
    assert all(c["finish_reason"] is None for c in chunks[:-1])
    assert events[-2][1]["usage"]["completion_tokens"] >= 4


def test_stop_matcher_holds_back_a_possible_stop():
    from kvrelay.control.stops import StopMatcher

    matcher = StopMatcher(["abc", "xy"])
    assert matcher.feed("12a") == "12"  # "a" may begin "abc"
    assert matcher.feed("b") == ""
    assert matcher.feed("d") == "abd"
    assert matcher.feed("qx") == "q"
    assert matcher.feed("yz") == "" and matcher.stopped
    assert matcher.feed("more") == "" and matcher.flush() == ""
    other = StopMatcher(["abc"])
    assert other.feed("xab") == "x" and other.flush() == "ab"
