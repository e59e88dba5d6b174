"""The tiny random models of the whole suite, one set: `model_dirs(name,
**overrides)` (a session fixture in tests/conftest.py) writes each name and
override once per pytest process; `prompt_tokens` makes their prompts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvrelay.model import RandomModelSpec, write_model

# A few layers, hidden 64. std 0.2 (>= 0.05) keeps greedy decoding from
# settling into a short loop that would hide errors.
STD = 0.2
TINY = {
    "llama-gqa": RandomModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, seed=1),
    "llama-mha": RandomModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=4, seed=2),
    "qwen2-gqa": RandomModelSpec(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, seed=3),
    "qwen2-mha": RandomModelSpec(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=4, seed=4),
    # TP up to 4 over 2 KV heads (TP > KV heads), PP 2 over 4 layers.
    "parallel": RandomModelSpec(
        arch="qwen2", layers=4, hidden=64, heads=8, kv_heads=2, intermediate=128, seed=5
    ),
    # The serving workers' and the integration cluster's llama (their own
    # seeds: the tests' prompts and stop tokens were chosen against them).
    "serving": RandomModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, seed=9),
    "cluster": RandomModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, seed=5),
}
TINY = {name: replace(spec, std=STD) for name, spec in TINY.items()}


class ModelDirs:
    """Writes each (name, overrides) once under `root`; returns its directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[tuple, Path] = {}

    def __call__(self, name: str, **overrides) -> Path:
        key = (name, repr(sorted(overrides.items())))
        if key not in self.made:
            spec = replace(TINY[name], **overrides)
            self.made[key] = write_model(self.root / f"{name}-{len(self.made)}", spec)
        return self.made[key]


def prompt_tokens(length: int, vocab: int = 256, seed: int = 0) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()
