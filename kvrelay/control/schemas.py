"""Pydantic models of the HTTP edge (the only place pydantic is used).

Each field constraint names the field in the error, so a 400 says exactly
what is wrong, and the OpenAPI schema states every constraint the server
checks (a schema-valid body is never refused for its form; the patterns in
`json_schema_extra` are the validators' own). Checks that need the registry
(vocabulary, known model) are made by the routes.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WrapValidator,
    field_validator,
)

MAX_TOKENS_LIMIT = 1 << 16  # per request; a worker's pool bounds it further
MAX_PROMPT_TOKENS = 1 << 20
MAX_TOKEN_ID = (1 << 31) - 1  # token ids are int32 on every worker
MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256
_PORT = "([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # a DNS label (IPv4 parts too)
ADDRESS_PATTERN = f"^{_LABEL}(\\.{_LABEL})*:{_PORT}$"
HEX64_PATTERN = "^[0-9a-fA-F]{64}$"
_ADDRESS = re.compile(ADDRESS_PATTERN)
_HEX64 = re.compile(HEX64_PATTERN)
MAX_COUNT = 1 << 40  # queue depths, page counts: far above any real value


def _integral(value):
    """JSON Schema counts 3.0 as an integer; strict pydantic would not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


def int_in(**bounds):
    """An integer within `bounds` (the Field first, so the schema states them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


NonNegative = int_in(ge=0, le=MAX_COUNT)
Positive = int_in(ge=1, le=MAX_COUNT)
# Bounds a JSON Schema validator compares exactly (floats carry 53 bits):
# bigger integers are counted as floats.
EXACT = 1 << 53
Counter = int_in(ge=-EXACT, le=EXACT) | Annotated[float, Field(ge=-1e300, le=1e300)]


# strict: no "3" for an integer, no 0 for a boolean: what the schema says.
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Lenient(BaseModel):
    # Workers are built separately: a field this control does not know yet is
    # ignored rather than failing every registration or heartbeat.
    model_config = ConfigDict(extra="ignore", strict=True)


def _check_namespace(value: str) -> str:
    if not _HEX64.fullmatch(value):
        raise ValueError("namespace must be 64 hex characters (a sha256 digest)")
    return value.lower()


class NodeRegistration(_Lenient):
    role: Literal["prefill", "decode"]
    address: str = Field(max_length=259, json_schema_extra={"pattern": ADDRESS_PATTERN})
    model: str = Field(min_length=1, max_length=256)
    namespace: str = Field(json_schema_extra={"pattern": HEX64_PATTERN})
    page_size: int_in(ge=1, le=1 << 20)
    # How the worker keys pages from tokens (kvrelay.layout.keys.KEY_SCHEMES).
    key_scheme: Literal["kvrelay", "sglang"] = "kvrelay"
    vocab_size: int_in(ge=1, le=MAX_TOKEN_ID + 1)
    tp: int_in(ge=1, le=1024) = 1
    pp: int_in(ge=1, le=1024) = 1
    num_pages: Positive
    cache: bool = False
    # The worker's model directory: control reads its tokenizer files there
    # (text prompts, chat); empty: the byte tokenizer.
    model_dir: str = Field("", max_length=4096)

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if not _ADDRESS.fullmatch(value):
            raise ValueError("address must be host:port with a port in 1-65535")
        return value

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return _check_namespace(value)


class Heartbeat(_Lenient):
    queued: NonNegative = 0
    active: NonNegative = 0
    free_pages: NonNegative = 0
    stats: dict[str, Counter] = Field(default_factory=dict)


TokenId = int_in(ge=0, le=MAX_TOKEN_ID)


_PROMPT_IDS = list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]]


def _integral_ids(value, handler):
    """A prompt's ids checked in one pass in C (msgspec: ints within bounds,
    no bool, no float, no Python call per id: a 1M-token prompt is checked
    in milliseconds). Anything else goes through pydantic's own validation
    (`handler`), and then once more with integral floats as integers (what
    `TokenId` allows), so the answers and their errors are `list[TokenId]`'s."""
    if isinstance(value, list) and 1 <= len(value) <= MAX_PROMPT_TOKENS:
        try:
            return msgspec.convert(value, _PROMPT_IDS)
        except msgspec.ValidationError:
            pass
    try:
        return handler(value)
    except ValidationError:
        if not isinstance(value, list):
            raise
        return handler([_integral(t) for t in value])


PromptIds = Annotated[
    list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]],
    Field(min_length=1, max_length=MAX_PROMPT_TOKENS),
    WrapValidator(_integral_ids),
]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _same(value, allowed) -> bool:
    """JSON equality: True is not 1, 0 is 0.0."""
    if allowed is None or isinstance(allowed, bool):
        return value is allowed
    if isinstance(allowed, int | float):
        return isinstance(value, int | float) and not isinstance(value, bool) and value == allowed
    return type(value) is type(allowed) and value == allowed


def _off_only(allowed: tuple, message: str) -> BeforeValidator:
    """An OpenAI parameter kvrelay does not implement: accepted only at the
    value that means "off", refused with the reason otherwise."""

    def check(value):
        if not any(_same(value, a) for a in allowed):
            raise ValueError(f"{message} (got {value!r})")
        return _integral(value)

    return BeforeValidator(check)


ONE_CHOICE = "only one choice per request is supported (n=1)"
NO_PENALTY = _off_only((0, 0.0), "penalties are not supported; send 0 or leave it out")
NO_NULL = _off_only((None,), "not supported; send null or leave it out")


class _Sampling(_Strict):
    """The fields completions and chat share: each one works, or (n,
    penalties, logit_bias) is accepted only at its "off" value and refused
    with the reason otherwise; an unknown field is refused."""

    model: str | None = None
    max_tokens: Int = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(0, ge=0, le=MAX_TOKEN_ID)
    seed: int_in(ge=0, le=EXACT) | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=1024)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    user: str | None = Field(None, max_length=256)  # the client's own tag; not used
    n: Annotated[Literal[1], _off_only((1,), ONE_CHOICE)] = 1
    presence_penalty: Annotated[Literal[0], NO_PENALTY] = 0
    frequency_penalty: Annotated[Literal[0], NO_PENALTY] = 0
    logit_bias: Annotated[
        Annotated[dict[str, float], Field(max_length=0)] | None,
        _off_only((None, {}), "logit_bias is not supported"),
    ] = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """`/v1/completions`: a text or token-id prompt; best_of, logprobs, echo
    and suffix only at their "off" value."""

    prompt: Annotated[str, Field(min_length=1)] | PromptIds
    best_of: Annotated[Literal[1] | None, _off_only((1, None), ONE_CHOICE)] = None
    logprobs: Annotated[None, NO_NULL] = None
    echo: Annotated[
        Literal[False], _off_only((False,), "echo is not supported; send false or leave it out")
    ] = False
    suffix: Annotated[None, NO_NULL] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        # Checked before the union, so the message is one reason, not one per member.
        if isinstance(value, str | list) and len(value) == 0:
            raise ValueError("prompt must not be empty")
        if (
            isinstance(value, list)
            and _may_be_negative(value)
            and any(isinstance(t, int) and not isinstance(t, bool) and t < 0 for t in value)
        ):
            raise ValueError("prompt token ids must not be negative")
        return value


def _may_be_negative(ids: list) -> bool:
    """False when no id can be negative, found by `min` in C (the common
    case); ids that do not compare (a string among them) need the loop."""
    try:
        return min(ids) < 0
    except TypeError:
        return True


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=1 << 22)


class ChatCompletionRequest(_Sampling):
    """`/v1/chat/completions`: messages through the model's chat template;
    logprobs and top_logprobs only at their "off" value."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    logprobs: Annotated[
        Literal[False] | None,
        _off_only((False, None), "logprobs are not supported; send false or null"),
    ] = None
    top_logprobs: Annotated[
        None, _off_only((None,), "top_logprobs are not supported; send null")
    ] = None


class FlushRequest(_Strict):
    namespace: str | None = Field(None, json_schema_extra={"pattern": HEX64_PATTERN})

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        return None if value is None else _check_namespace(value)


class DrainRequest(_Strict):
    node_id: str = Field(min_length=1)
