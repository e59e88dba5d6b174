"""Fitting a random model's MTP layer to its own target (`make-model --mtp-fit-steps`).

A random MTP layer almost never agrees with its target, so speculation would
accept nothing and every accept path would go untested. This fits the MTP
layer (the target stays frozen) for a few hundred Adam steps on this CPU:

1. the target greedily continues random short prompts (kvrelay's own engine,
   float32), which is the distribution speculation later sees;
2. for each sequence the target's final-normed hidden states h_i and its
   argmax at every position are recorded;
3. the MTP layer, run over whole sequences with causal attention (the same
   math as `kvrelay.model.mtp.MtpLayer`, unpaged and differentiable), is fitted
   with cross-entropy so that slot i (h_i, token i + 1) predicts the target's
   argmax at position i + 1, the token the target will verify.

The fitted tensors replace the MTP tensors in the checkpoint file(s).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvrelay.layout import DEFAULT_PAGE_SIZE
from kvrelay.model.config import ModelConfig
from kvrelay.model.decoder import rms_norm
from kvrelay.model.engine import Request
from kvrelay.model.mtp import mtp_prefix
from kvrelay.model.rope import RotaryEmbedding, apply_rotary
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.weights import weight_files


def target_traces(model_dir, sequences: int, prompt: int, length: int, seed: int):
    """Greedy continuations, with the target's hidden states and argmax per position."""
    from kvrelay.model.loader import load_engine

    config = ModelConfig.from_dir(model_dir)
    engine = load_engine(
        model_dir, dtype="float32", page_size=DEFAULT_PAGE_SIZE, num_pages=8 * sequences
    )
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, config.vocab_size, (prompt,), generator=gen).tolist()
        for _ in range(sequences)
    ]
    results = engine.generate([Request(p, SamplingParams(length - prompt)) for p in prompts])
    tokens = torch.tensor([p + r.tokens for p, r in zip(prompts, results, strict=True)])
    engine.pool.clear_cache()
    engine.shard.keep_hidden = True
    hidden, argmax = [], []
    for row in tokens.tolist():
        out = engine.generate([Request(row, SamplingParams(1), return_logits=True)])[0]
        hidden.append(engine.shard.last_hidden.clone())
        argmax.append(out.prompt_logits.argmax(-1))
    return tokens, torch.stack(hidden), torch.stack(argmax)


def mtp_forward(params: dict, config: ModelConfig, tokens, hidden, rope: RotaryEmbedding):
    """Differentiable MTP logits of slots 0 .. T - 2 of [B, T] sequences."""
    eps, hd = config.rms_norm_eps, config.head_dim
    p = {name.removeprefix(mtp_prefix(config)): t for name, t in params.items()}
    nxt, h = tokens[:, 1:], hidden[:, :-1]
    batch, length = nxt.shape
    embedded = F.embedding(nxt, params["model.embed_tokens.weight"])
    joined = torch.cat(
        [rms_norm(embedded, p["enorm.weight"], eps), rms_norm(h, p["hnorm.weight"], eps)], -1
    )
    x = F.linear(joined, p["eh_proj.weight"])
    cos, sin = rope.cos_sin(torch.arange(length), x.dtype)
    a = "self_attn."
    y = rms_norm(x, p["input_layernorm.weight"], eps)

    def proj(name, heads):
        out = F.linear(y, p[a + name + ".weight"], p.get(a + name + ".bias"))
        return (
            apply_rotary(
                out.view(batch * length, heads, hd), cos.repeat(batch, 1), sin.repeat(batch, 1)
            )
            if name != "v_proj"
            else out.view(batch * length, heads, hd)
        )

    q = proj("q_proj", config.num_heads).view(batch, length, -1, hd).transpose(1, 2)
    k = proj("k_proj", config.num_kv_heads).view(batch, length, -1, hd).transpose(1, 2)
    v = proj("v_proj", config.num_kv_heads).view(batch, length, -1, hd).transpose(1, 2)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    attn = attn.transpose(1, 2).reshape(batch, length, -1)
    x = x + F.linear(attn, p[a + "o_proj.weight"], p.get(a + "o_proj.bias"))
    y = rms_norm(x, p["post_attention_layernorm.weight"], eps)
    m = "mlp."
    gate = F.linear(y, p[m + "gate_proj.weight"], p.get(m + "gate_proj.bias"))
    up = F.linear(y, p[m + "up_proj.weight"], p.get(m + "up_proj.bias"))
    x = x + F.linear(F.silu(gate) * up, p[m + "down_proj.weight"], p.get(m + "down_proj.bias"))
    g = rms_norm(x, p["shared_head.norm.weight"], eps)
    head = params.get("lm_head.weight", params["model.embed_tokens.weight"])
    return F.linear(g, head)


def fit_mtp(
    model_dir,
    steps: int,
    *,
    lr: float = 3e-3,
    seed: int = 0,
    sequences: int = 8,
    length: int = 64,
    log=None,
) -> dict:
    """Fits the MTP layer of `model_dir` in place; returns the agreement
    (draft argmax == target argmax) on the fitting data before and after."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    tokens, hidden, argmax = target_traces(model_dir, sequences, prompt=8, length=length, seed=seed)
    labels = argmax[:, 1:]
    files = weight_files(model_dir)
    prefix = mtp_prefix(config)
    shared = ["model.embed_tokens.weight"] + (
        [] if config.tie_word_embeddings else ["lm_head.weight"]
    )
    names = [n for n in files if n.startswith(prefix)]
    loaded = {file: load_file(str(file)) for file in {files[n] for n in names + shared}}
    stored = {n: loaded[files[n]][n] for n in names + shared}
    dtypes = {n: t.dtype for n, t in stored.items()}
    params = {n: t.to(torch.float32).clone().requires_grad_(n in names) for n, t in stored.items()}
    rope = RotaryEmbedding(config)
    optimizer = torch.optim.Adam([params[n] for n in names], lr=lr)

    def agreement() -> float:
        with torch.no_grad():
            return float(
                (mtp_forward(params, config, tokens, hidden, rope).argmax(-1) == labels)
                .float()
                .mean()
            )

    before = agreement()
    for step in range(steps):
        logits = mtp_forward(params, config, tokens, hidden, rope)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if log is not None and (step % 50 == 0 or step == steps - 1):
            log(f"fit step {step}: loss {loss.item():.3f}")
    after = agreement()
    for file in sorted({files[n] for n in names}):
        tensors = load_file(str(file))
        for n in names:
            if files[n] == file:
                tensors[n] = params[n].detach().to(dtypes[n]).contiguous()
        save_file(tensors, str(file), metadata={"format": "pt"})
    return {"agreement_before": before, "agreement_after": after, "steps": steps}
