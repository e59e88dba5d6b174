"""A small real tokenizer for `kvrelay make-model`: `tokenizer.json` (a
byte-level BPE built with `tokenizers`, token id = byte value, so text
prompts encode exactly as the byte tokenizer did) and `tokenizer_config.json`
with a chat template in the Hugging Face format.

Random models have no trained merges; the byte-level vocabulary is the
smallest real tokenizer that every text round-trips through.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTE_TOKENS = 256

# Plain-text role markers (no special tokens), so the template works with a
# vocabulary of only the 256 bytes.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the
    others are shifted past 255, so every byte is one visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    mapping, shift = {}, 0
    for byte in range(BYTE_TOKENS):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(BYTE_TOKENS + shift)
            shift += 1
    return mapping


def write_tokenizer(directory: str | Path, vocab_size: int) -> bool:
    """Write the tokenizer files; False (nothing written) for a vocabulary
    smaller than the 256 byte tokens."""
    if vocab_size < BYTE_TOKENS:
        return False
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    root = Path(directory)
    tokenizer.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
              "model_max_length": 1 << 20}  # fmt: skip
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return True
