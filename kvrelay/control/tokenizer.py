"""Text <-> tokens for each served model.

A model directory with a `tokenizer.json` is read with the `tokenizers`
library (the same file Hugging Face loads), and its `tokenizer_config.json`
chat template is rendered with jinja2 in a sandbox, as transformers does.
A model that ships no tokenizer falls back to the byte tokenizer (one token
per UTF-8 byte, ids 0-255; needs a vocabulary of at least 256) and has no
chat template. Control finds the directory through the `model_dir` its
workers register; a directory control cannot read is an error for text,
never a silent fallback to bytes.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable
from pathlib import Path

BYTE_VOCAB = 256


class TokenizerError(Exception):
    """Text cannot be handled for this model (the message says why)."""


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: Iterable[int]) -> str:
    """Text of the byte tokens; ids >= 256 carry no text."""
    return bytes(t for t in tokens if 0 <= t < BYTE_VOCAB).decode("utf-8", errors="replace")


class StreamDecoder:
    """Decodes byte-token batches as they stream, so a character split over
    two batches comes out whole instead of as two replacement characters."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tokens: Iterable[int]) -> str:
        return self._decoder.decode(bytes(t for t in tokens if 0 <= t < BYTE_VOCAB))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteCodec:
    name = "bytes"
    chat_template: str | None = None

    def __init__(self, vocab: int, model: str) -> None:
        self.vocab, self.model = vocab, model

    def encode(self, text: str) -> list[int]:
        if self.vocab < BYTE_VOCAB:
            raise TokenizerError(f"text prompts need a vocabulary of at least {BYTE_VOCAB} "
                                 f"(byte tokens); {self.model} has {self.vocab} and ships no "
                                 f"tokenizer.json: send token ids")  # fmt: skip
        return encode(text)

    def stream(self) -> StreamDecoder:
        return StreamDecoder()


class _HFStream:
    """Incremental detokenization (`tokenizers`' DecodeStream holds back
    bytes of an unfinished character). Ids the tokenizer has no token for (a
    model's vocabulary may be padded past its tokenizer's) give no text and
    are dropped before the stream: it keeps every id that has given no text
    yet and decodes them all again at each step, so a run of them would cost
    time quadratic in its length."""

    def __init__(self, tokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        self._stream = DecodeStream(skip_special_tokens=True)

    def feed(self, tokens: Iterable[int]) -> str:
        step, tokenizer, vocab = self._stream.step, self._tokenizer, self._vocab
        return "".join(step(tokenizer, t) or "" for t in tokens if 0 <= t < vocab)

    def flush(self) -> str:
        return ""


class HFCodec:
    name = "tokenizer.json"

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template = config.get("chat_template")
        self.chat_template = template if isinstance(template, str) else None
        self.special = {k: v for k, v in config.items()
                        if k in ("bos_token", "eos_token") and isinstance(v, str)}  # fmt: skip

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def stream(self) -> _HFStream:
        return _HFStream(self.tokenizer)

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template applied as transformers' `apply_chat_template(
        ..., add_generation_prompt=True, tokenize=False)` does."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TokenizerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, **self.special
            )
        except TokenizerError:
            raise
        except Exception as exc:  # a template error is the template's, shown to the client
            raise TokenizerError(f"chat template failed: {exc}") from exc


class Codecs:
    """One codec per (model, directory), loaded on first use."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str], HFCodec | ByteCodec] = {}

    def for_model(self, model: str, model_dir: str, vocab: int) -> HFCodec | ByteCodec:
        key = (model, model_dir)
        if key not in self._loaded:
            self._loaded[key] = self._load(model, model_dir, vocab)
        return self._loaded[key]

    @staticmethod
    def _load(model: str, model_dir: str, vocab: int) -> HFCodec | ByteCodec:
        if not model_dir:
            return ByteCodec(vocab, model)
        directory = Path(model_dir)
        if not directory.is_dir():
            raise TokenizerError(f"the workers of {model} load it from {model_dir}, which "
                                 f"control cannot read: text needs its tokenizer; send "
                                 f"token ids")  # fmt: skip
        if not (directory / "tokenizer.json").exists():
            return ByteCodec(vocab, model)
        try:
            return HFCodec(directory)
        except Exception as exc:  # a broken file: say which, do not guess
            raise TokenizerError(f"cannot load {directory / 'tokenizer.json'}: {exc}") from exc
