"""vLLM's DSA indexer caches on unified pages: the layout the connector will
use once DSA runs (vLLM runs it on GPUs only), tested on CPU tensors with a
torch rendering of vLLM's `indexer_k_quant_and_cache` write."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvrelay.adapters.vllm.blocks import BlockLayoutError
from kvrelay.adapters.vllm.indexer_blocks import (
    dsa_spec,
    index_layers,
    indexer_block_view,
    page_indexer_run,
    record_bytes,
)
from kvrelay.layout import ModelKVSpec

BLOCK, HEAD = 64, 128
RECORD = HEAD + 4
FP8 = torch.float8_e4m3fn


def vllm_indexer_write(cache: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor) -> None:
    """vLLM's quantize-and-cache of indexer keys, in torch: per token a scale
    of amax / 448 (at least 1e-4), the fp8 keys at the token's place in the
    block's first `BLOCK * HEAD` bytes and the float32 scale in the rest."""
    values = cache[:, : BLOCK * HEAD].view(FP8)
    scales = cache[:, BLOCK * HEAD :].view(torch.float32)
    for key, slot in zip(keys, slots.tolist(), strict=True):
        block, offset = divmod(slot, BLOCK)
        scale = torch.clamp(key.abs().max(), min=1e-4) / 448.0
        values[block, offset * HEAD : (offset + 1) * HEAD] = (key / scale).to(FP8)
        scales[block, offset] = scale


def latent_spec(layers: int) -> ModelKVSpec:
    return ModelKVSpec(
        model_id="m", weights_fingerprint="", num_layers=layers, num_kv_heads=1,
        k_head_dim=576, v_head_dim=0, kv_dtype="bfloat16", attention_kind="mla",
        page_size=BLOCK, rope_head_dim=64,
    )  # fmt: skip


def text_config(layers: int, indexer_types=None):
    return SimpleNamespace(num_hidden_layers=layers, index_head_dim=HEAD, index_topk=2048,
                           indexer_types=indexer_types)  # fmt: skip


def test_the_indexer_record_is_keys_then_scales_as_sglangs_page():
    assert record_bytes(128) == 132 and record_bytes(256) == 264
    with pytest.raises(BlockLayoutError):
        record_bytes(100)
    # V3.2 runs every layer's indexer, GLM-5 its "full" layers only
    assert index_layers(text_config(3)) == (0, 1, 2)
    assert index_layers(text_config(4, ["full", "shared", "full", "shared"])) == (0, 2)
    with pytest.raises(BlockLayoutError, match="indexer_types"):
        index_layers(text_config(3, ["full", "shared"]))
    spec = dsa_spec(latent_spec(4), text_config(4, ["full", "shared", "full", "shared"]))
    # SGLang's adapter files its DSA pages with the same fields (pools.indexed_spec)
    assert (spec.index_head_dim, spec.index_dtype, spec.index_layers, spec.index_topk) == (
        RECORD,
        "uint8",
        (0, 2),
        2048,
    )
    latent = BLOCK * 576 * 2
    assert spec.page_bytes == 4 * latent + 2 * BLOCK * RECORD
    assert page_indexer_run(spec, 0) == (latent, BLOCK * RECORD)
    assert page_indexer_run(spec, 2) == (3 * latent + BLOCK * RECORD, BLOCK * RECORD)
    with pytest.raises(BlockLayoutError, match="no indexer keys"):
        page_indexer_run(spec, 1)


def test_a_block_of_vllms_indexer_cache_is_a_pages_record_byte_for_byte():
    torch.manual_seed(0)
    spec = dsa_spec(latent_spec(2), text_config(2))
    cache = torch.zeros(5, 1, BLOCK, RECORD, dtype=torch.uint8)  # as vLLM binds it
    slots = torch.cat([torch.arange(3 * BLOCK, 4 * BLOCK), torch.arange(BLOCK, 2 * BLOCK)])
    keys = torch.randn(len(slots), HEAD) * torch.linspace(0.1, 10, len(slots))[:, None]
    vllm_indexer_write(cache.view(5, -1), keys, slots)
    blocks = indexer_block_view(cache, BLOCK, RECORD)
    assert blocks.data_ptr() == cache.data_ptr()  # a view: gathers read the engine's memory
    page = torch.zeros(2, spec.page_bytes, dtype=torch.uint8)
    for i, block in enumerate((3, 1)):  # the request's blocks into its pages, layer 1
        offset, length = page_indexer_run(spec, 1)
        page[i, offset : offset + length] = blocks[block]
    # Read back as SGLang's page record: every token's fp8 key, then its scale
    offset, length = page_indexer_run(spec, 1)
    record = page[:, offset : offset + length]
    values = record[:, : BLOCK * HEAD].contiguous().view(FP8).float().view(2 * BLOCK, HEAD)
    scales = record[:, BLOCK * HEAD :].contiguous().view(torch.float32).reshape(-1, 1)
    assert torch.allclose(values * scales, keys, rtol=0.07, atol=1e-3)
    assert not bool(page[:, :offset].any())  # the latent rows are not touched


def test_an_indexer_cache_of_another_geometry_is_refused():
    with pytest.raises(BlockLayoutError, match="indexer cache block"):
        indexer_block_view(torch.zeros(2, BLOCK * 128, dtype=torch.uint8), BLOCK, RECORD)
