"""Control's msgspec body decoder reads every body as `json.loads` does
(falling back to it where msgspec refuses), and a prompt's id list keeps
its answers: integral floats accepted, negatives, bools, strings and ids
beyond int32 refused with their reasons."""

import json

import pytest
from pydantic import ValidationError

from kvrelay.control.fast_json import decode_json
from kvrelay.control.schemas import MAX_TOKEN_ID, CompletionRequest


@pytest.mark.parametrize(
    "body",
    [b'{"prompt": [1, 2, 3], "max_tokens": 4}', b'{"a": 1, "a": 2}',
     b"123456789012345678901234567890",
     b'{"a": NaN}', b"1e400", b'"\\ud800"', b'{"x": [1.5, -0.0, true, null, "s"]}'],
)  # fmt: skip
def test_decode_json_reads_as_json_loads(body):
    got, want = decode_json(body), json.loads(body)
    assert repr(got) == repr(want)


@pytest.mark.parametrize("body", [b"[1, 2", b"", b"{", b'{"a": }'])
def test_decode_json_raises_json_loads_errors(body):
    with pytest.raises(json.JSONDecodeError):
        decode_json(body)


def test_prompt_ids_accept_ints_and_integral_floats():
    assert CompletionRequest.model_validate({"prompt": [0, 5, MAX_TOKEN_ID]}).prompt == [
        0, 5, MAX_TOKEN_ID
    ]  # fmt: skip
    assert CompletionRequest.model_validate({"prompt": [3.0, 4]}).prompt == [3, 4]


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [([1, -1], "must not be negative"), ([1, "a"], "valid integer"), ([True], "valid integer"),
     ([1, 2.5], "valid integer"), ([MAX_TOKEN_ID + 1], "less than or equal"), ([], "empty")],
)  # fmt: skip
def test_prompt_ids_refuse_bad_ids_with_a_reason(prompt, reason):
    with pytest.raises(ValidationError, match=reason):
        CompletionRequest.model_validate({"prompt": prompt})
