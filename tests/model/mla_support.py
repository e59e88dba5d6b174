"""Tiny GLM-5 / DeepSeek-V3.2 / DeepSeek-V3 models for the MLA tests, and
their transformers oracle in float64."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvrelay.model.make_mla_model import MlaModelSpec, write_mla_model

ARCHS = ("glm5", "deepseek_v32", "deepseek_v3")

# index_topk 32 below the tests' prompts (100-300 tokens), so the indexer
# decides what each query sees; GLM-5 with a shared layer (freq 2: layers
# 0, 1 full, 2 shared); V3 with plain q_proj (no q LoRA). std 0.2 keeps greedy
# decoding off short loops.
MLA_TINY = {
    "glm5": MlaModelSpec(arch="glm5", layers=3, index_topk_freq=2, std=0.2, seed=11),
    "deepseek_v32": MlaModelSpec(arch="deepseek_v32", layers=3, std=0.2, seed=12),
    "deepseek_v3": MlaModelSpec(arch="deepseek_v3", layers=3, q_lora_rank=None, std=0.2, seed=13),
}


class MlaModelDirs:
    def __init__(self, root) -> None:
        self.root = root
        self.made: dict[tuple, object] = {}

    def __call__(self, arch: str, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in self.made:
            spec = replace(MLA_TINY[arch], **overrides)
            self.made[key] = write_mla_model(self.root / f"{arch}-{len(self.made)}", spec)
        return self.made[key]


def hf_mla_model(model_dir, dtype=torch.float64):
    """transformers' model with eager experts (its grouped-mm experts reject
    float64) and SDPA attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="sdpa"
    )
    model.config._experts_implementation = "eager"
    return model.eval()
