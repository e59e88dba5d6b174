"""vLLM MLA blocks <-> kvrelay unified MLA pages.

vLLM's MLA attention backends (the CPU one and the GPU ones alike) cache one
latent row per token and layer, `[num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim]`: `kv_c_normed` then the rotated RoPE key `k_pe`, as the
model computed them. A unified MLA page holds the same rows per layer
(`kvrelay.layout`: one head, no V), so a block is a page's layer block up to
the order of the RoPE part:

- vLLM's DeepSeek-family attention rotates `k_pe` GPT-J style
  (`get_rope(..., is_neox_style=False)`): the pairs (x0, x1), (x2, x3), ...
  are rotated in place, and the cache holds them interleaved;
- unified pages hold the RoPE part as kvrelay's runner and transformers'
  `apply_rotary_pos_emb_interleave` return it: the rotated evens, then the
  rotated odds.

The two hold the same values; only their positions differ. The mapping is
one index vector over a block's `[block_size, width]` region, the form
`BlockPages` takes for MHA blocks (`perm[j]`: the region position of unified
element j), so loading, writing and the P/D handoff treat MLA blocks as MHA
blocks of one head.
"""

from __future__ import annotations

import torch

from kvrelay.adapters.vllm.blocks import BlockLayoutError


def latent_permutation(block_size: int, width: int, rope: int, rope_pairs: bool) -> torch.Tensor:
    """perm (int64, block_size * width): unified element j sits at region[perm[j]].

    `width` is the latent row (`kv_lora_rank + rope`); `rope_pairs`: the cache
    holds the RoPE part as interleaved pairs (vLLM's DeepSeek models)."""
    if not 0 <= rope < width or rope % 2:
        raise BlockLayoutError(f"a RoPE part of {rope} in a {width}-wide latent row")
    row = torch.arange(width, dtype=torch.int64)
    if rope_pairs and rope:
        half, start = rope // 2, width - rope
        # unified r < half is the rotated even r; r >= half the odd r - half
        row[start : start + half] = start + 2 * torch.arange(half)
        row[start + half :] = start + 2 * torch.arange(half) + 1
    tokens = torch.arange(block_size, dtype=torch.int64)[:, None] * width
    return (tokens + row).reshape(-1)


def latent_block_view(cache: torch.Tensor) -> torch.Tensor:
    """A layer's MLA cache as `[num_blocks, 1, block_size, width]` (one head),
    a view of the same memory: vLLM hands it over 3-D, or 4-D with one head."""
    if cache.dim() == 4 and cache.shape[1] == 1:
        return cache
    if cache.dim() != 3:
        raise BlockLayoutError(
            f"an MLA cache is [blocks, block_size, latent width]; got {tuple(cache.shape)}"
        )
    return cache.unsqueeze(1)
