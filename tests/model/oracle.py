"""The Hugging Face transformers reference: same weights, SDPA attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class OracleRun:
    prompt_logits: torch.Tensor  # [prompt, vocab]
    tokens: list[int]  # greedy continuation
    step_logits: list[torch.Tensor]  # logits that chose each token
    keys: list[torch.Tensor]  # per layer [kv_heads, tokens, head_dim], post-RoPE
    values: list[torch.Tensor]


def hf_model(model_dir, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="sdpa"
    )
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new_tokens: int) -> OracleRun:
    """Prefill, then greedy decoding one token at a time through HF's own cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    device = model.device  # CPU, or the GPU the model was moved to
    out = model(torch.tensor([prompt], device=device), cache=cache, use_cache=True)
    prompt_logits = out.logits[0]
    logits = prompt_logits[-1]
    tokens, steps = [], []
    for i in range(new_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        steps.append(logits)
        if i + 1 < new_tokens:
            step = torch.tensor([[token]], device=device)
            logits = model(step, cache=cache, use_cache=True).logits[0, -1]
    keys = [layer.keys[0] for layer in cache.layers]
    values = [layer.values[0] for layer in cache.layers]
    return OracleRun(prompt_logits, tokens, steps, keys, values)
