"""Rotary position embeddings with the common `rope_scaling` types.

The frequencies and the cos/sin tables are computed in float32 whatever the
model dtype, then cast: that is how these models were trained and how the
Hugging Face reference computes them, so a float64 run matches it to rounding
of the float64 arithmetic that follows.
"""

from __future__ import annotations

import math

import torch

from kvrelay.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 [head_dim / 2] rotation frequencies, scaled per `config.rope_scaling`."""
    return rope_parameters(config)[0]


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor that scales cos and sin)."""
    dim, base = config.head_dim, config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    scaling = config.rope_scaling or {}
    kind = config.rope_type
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling, config.max_position_embeddings), 1.0
    if kind == "yarn":
        return _yarn(config, scaling)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, scaling: dict, max_positions: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth
    blend between `low_freq_factor` and `high_freq_factor`."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling.get("original_max_position_embeddings") or max_positions)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(config: ModelConfig, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies interpolated by `factor` below a ramp of dimensions and
    kept above it (`beta_fast`/`beta_slow` rotations over the original context),
    and cos/sin scaled by an attention factor (0.1 ln(factor) + 1 by default)."""
    dim, base = config.head_dim, config.rope_theta
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = scaling.get("factor") or config.max_position_embeddings / original

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        weight, weight_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if weight and weight_all:
            attention = mscale(factor, weight) / mscale(factor, weight_all)
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


class RotaryEmbedding:
    """cos/sin of token positions; `apply` rotates q or k in place of a copy."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq, self.attention_factor = rope_parameters(config)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """[tokens, head_dim] cos and sin for int64 `positions`."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (rotate-half convention)."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
