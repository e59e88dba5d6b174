"""RoPE as the MLA family applies it to a rotary slice of q and k.

The cos/sin tables are `kvrelay.model.rope`'s (float32 angles, the yarn
attention factor folded in, cast to the model dtype), `[tokens, rope_dim]`
as cat(freqs, freqs). Two layouts of the rotated pairs:

- interleaved (DeepSeek's weights: pairs (x0, x1), (x2, x3), ...), written
  back de-interleaved, evens then odds, exactly as transformers'
  `apply_rotary_pos_emb_interleave` returns them: the latent rows in the
  cache hold that layout, so pages match transformers' cache byte for byte;
- half-split (`rotate_half`), the Llama convention (V3.2's indexer).
"""

from __future__ import annotations

import torch

from kvrelay.model.rope import apply_rotary


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """x: [tokens, heads, rope_dim]; cos/sin: [tokens, rope_dim]."""
    if not interleaved:
        return apply_rotary(x, cos, sin)
    half = cos.size(-1) // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
