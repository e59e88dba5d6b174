"""vLLM's DeepSeek sparse attention (DSA) indexer caches <-> the indexer part
of unified MLA pages.

vLLM caches a DSA layer's indexer keys quantized, one cache per layer whose
indexer runs (`DeepseekV32IndexerCache`, `[num_blocks, block_size * R]`
bytes): a block holds its tokens' fp8 keys (`index_head_dim` bytes each)
and then their float32 scales (one per 128 key values), `R` bytes per token
in all. SGLang's DSA device pool lays out a page the same way, and its
adapter files that page record as the layer's indexer part of a unified
page (`index_dtype="uint8"`, `index_head_dim=R`). The layout here is that
one, so an engine of either kind names and reads the other's DSA pages: a
block is a page's indexer record byte for byte when the block size is the
page size. kvrelay's runner keeps its indexer keys in the model dtype:
its DSA pages are another namespace.

vLLM runs sparse attention on GPUs only; the connector refuses DSA models
until this path has run on one (`identity.engine_spec`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvrelay.adapters.vllm.blocks import BlockLayoutError
from kvrelay.layout import ModelKVSpec

QUANT_BLOCK = 128  # key values per float32 scale, in vLLM's and SGLang's indexer caches


def record_bytes(index_head_dim: int) -> int:
    """Bytes of one token's quantized indexer key: fp8 values and their scales."""
    if index_head_dim <= 0 or index_head_dim % QUANT_BLOCK:
        raise BlockLayoutError(f"an indexer key of {index_head_dim} is not whole scale groups")
    return index_head_dim + index_head_dim // QUANT_BLOCK * 4


def index_layers(text_config) -> tuple[int, ...]:
    """Layers whose indexer runs (and so hold keys): GLM-5's `indexer_types`
    "full" layers (a "shared" one reuses the last full layer's top-k), else
    every layer (DeepSeek-V3.2)."""
    kinds = getattr(text_config, "indexer_types", None)
    layers = int(text_config.num_hidden_layers)
    if not kinds:
        return tuple(range(layers))
    if len(kinds) != layers or set(kinds) - {"full", "shared"}:
        raise BlockLayoutError(f"indexer_types {kinds!r} is not one 'full'/'shared' per layer")
    return tuple(i for i, kind in enumerate(kinds) if kind == "full")


def dsa_spec(latent: ModelKVSpec, text_config) -> ModelKVSpec:
    """The unified page of a DSA model: `latent`'s, with each indexer layer's
    quantized key records after its latent rows."""
    return replace(
        latent,
        index_head_dim=record_bytes(int(text_config.index_head_dim)),
        index_dtype="uint8",
        index_layers=index_layers(text_config),
        index_topk=int(text_config.index_topk),
    )


def indexer_block_view(cache: torch.Tensor, block_size: int, record: int) -> torch.Tensor:
    """A layer's indexer cache as `[num_blocks, block_size * record]` bytes (a
    view): vLLM binds it `[blocks, 1, block_size, record]` or squeezed to 3-D."""
    blocks = cache.view(torch.uint8).reshape(cache.shape[0], -1)
    if blocks.shape[1] != block_size * record:
        raise BlockLayoutError(
            f"an indexer cache block of {blocks.shape[1]} bytes, not {block_size} x {record}"
        )
    return blocks


def page_indexer_run(spec: ModelKVSpec, layer: int) -> tuple[int, int]:
    """(offset, bytes) of `layer`'s indexer record in a unified page."""
    if layer not in spec.index_layers:
        raise BlockLayoutError(f"layer {layer} holds no indexer keys")
    rows = spec.page_size * (spec.k_row_bytes + spec.v_row_bytes)
    return spec.layer_offset(layer) + rows, spec.page_size * spec.index_row_bytes
