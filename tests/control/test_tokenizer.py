"""Text through the model's own tokenizer (tokenizer.json via `tokenizers`),
chat through its chat template, and the tokenizer `make-model` writes
(checked against transformers, the oracle)."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kvrelay.control.tokenizer import HFCodec
from kvrelay.model.tokenizer_files import CHAT_TEMPLATE, write_tokenizer
from tests.control.sse import parse_sse

HELLO = [{"role": "user", "content": "hello"}]
WORDS = ["[UNK]", "hello", "world", "one", "two", "three", "four", "five", "six", "seven"]


@pytest.fixture
def word_model(tmp_path):
    """A model directory whose tokenizer is not bytes: one id per word."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path, tokenizer


@pytest.fixture
def byte_model(tmp_path):
    """What `kvrelay make-model` writes: byte-level BPE and a chat template."""
    assert write_tokenizer(tmp_path, 512)
    return tmp_path


def serve(cluster, model_dir, vocab=512):
    control = cluster.control()
    prefill = cluster.worker("prefill", model_dir=str(model_dir), vocab=vocab)
    decode = cluster.worker("decode", model_dir=str(model_dir), vocab=vocab)
    return control, prefill, decode


def test_text_prompt_uses_the_models_tokenizer(cluster, word_model):
    directory, tokenizer = word_model
    control, prefill, _ = serve(cluster, directory)
    reply = control.http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    assert prefill.requests[0]["tokens"] == [1, 2]  # words, not bytes
    choice = reply.json()["choices"][0]
    assert choice["token_ids"] == [3, 4, 5, 6]
    assert choice["text"] == tokenizer.decode([3, 4, 5, 6]) == "one two three four"


def test_word_tokenizer_streams_the_same_text(cluster, word_model):
    directory, _ = word_model
    control, _, _ = serve(cluster, directory)
    body = {"prompt": "hello world", "max_tokens": 5}
    whole = control.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with control.http.stream("POST", "/v1/completions", json=body | {"stream": True}) as reply:
        events = parse_sse(reply.read().decode())
    assert "".join(d["choices"][0]["text"] for _, d in events[:-1]) == whole


def test_chat_completion_through_the_template(cluster, byte_model):
    control, prefill, _ = serve(cluster, byte_model)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    reply = control.http.post("/v1/chat/completions",
                              json={"messages": messages, "max_tokens": 3})  # fmt: skip
    assert reply.status_code == 200, reply.text
    rendered = "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert prefill.requests[0]["tokens"] == list(rendered.encode())
    body = reply.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    # The fake's answer after "\n" (10): 11, 12, 13.
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "\x0b\x0c\r"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(rendered.encode())


def test_chat_streaming_sends_deltas(cluster, byte_model):
    control, _, _ = serve(cluster, byte_model)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True}
    with control.http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(reply.read().decode())
    assert events[-1] == ("message", "[DONE]")
    chunks = [data for _, data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "\x0b\x0c\r\x0e"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_without_a_template_is_400(cluster, word_model):
    directory, _ = word_model  # a tokenizer.json, no tokenizer_config.json
    control, prefill, _ = serve(cluster, directory)
    reply = control.http.post("/v1/chat/completions", json={"messages": HELLO})
    assert reply.status_code == 400
    assert "has no chat template" in reply.json()["error"]["message"]
    assert prefill.requests == []


def test_chat_with_the_byte_tokenizer_is_400(cluster):
    control, _, _ = serve(cluster, "")
    reply = control.http.post("/v1/chat/completions", json={"messages": HELLO})
    assert reply.status_code == 400 and "no chat template" in reply.json()["error"]["message"]


def test_unreadable_model_dir_refuses_text_but_serves_ids(cluster, tmp_path):
    control, _, _ = serve(cluster, tmp_path / "elsewhere")
    reply = control.http.post("/v1/completions", json={"prompt": "hello"})
    assert reply.status_code == 400
    assert "which control cannot read" in reply.json()["error"]["message"]
    reply = control.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["choices"][0]["token_ids"] == [3, 4]


def test_make_model_tokenizer_matches_transformers(byte_model):
    transformers = pytest.importorskip("transformers")
    oracle = transformers.AutoTokenizer.from_pretrained(str(byte_model))
    codec = HFCodec(byte_model)
    text = "héllo, wörld € 🙂\n\tend"
    assert codec.encode(text) == oracle.encode(text, add_special_tokens=False)
    assert codec.encode(text) == list(text.encode())  # id = byte, as the byte tokenizer
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "more"}]  # fmt: skip
    assert codec.render_chat(messages) == oracle.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )  # fmt: skip
    config = json.loads((byte_model / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


def test_ids_past_the_tokenizers_vocabulary_give_no_text(byte_model):
    stream = HFCodec(byte_model).stream()
    # A model's vocabulary may be padded past its tokenizer's: such ids are
    # dropped, and the stream still decodes what follows them.
    assert stream.feed([1 << 30, 600, -1]) == ""
    assert stream.feed([104, 1 << 30, 105]) == "hi"


def test_make_model_writes_no_tokenizer_below_256_tokens(tmp_path):
    assert not write_tokenizer(tmp_path, 100)
    assert not (tmp_path / "tokenizer.json").exists()
