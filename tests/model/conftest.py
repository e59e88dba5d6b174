import os
from dataclasses import replace

import pytest

from kvrelay.model import RandomModelSpec, write_model

# The HF oracle loads only local directories written by the tests: never ask the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Tiny models: a few layers, hidden 64. std 0.2 (>= 0.05) keeps greedy decoding
# from settling into a short loop that would hide errors.
MODELS = {
    "llama-gqa": RandomModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, seed=1),
    "llama-mha": RandomModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=4, seed=2),
    "qwen2-gqa": RandomModelSpec(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, seed=3),
    "qwen2-mha": RandomModelSpec(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=4, seed=4),
    # TP up to 4 over 2 KV heads (TP > KV heads), PP 2 over 4 layers.
    "parallel": RandomModelSpec(
        arch="qwen2", layers=4, hidden=64, heads=8, kv_heads=2, intermediate=128, seed=5
    ),
}
STD = 0.2


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    made = {}

    def get(name: str, **overrides):
        key = (name, repr(sorted(overrides.items())))
        if key not in made:
            spec = replace(MODELS[name], std=STD, **overrides)
            made[key] = write_model(root / f"{name}-{len(made)}", spec)
        return made[key]

    return get


def prompt_tokens(length: int, vocab: int = 256, seed: int = 0) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()
