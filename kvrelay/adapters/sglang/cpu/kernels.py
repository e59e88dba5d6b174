"""Pure-torch stand-ins for the `sgl_kernel` ops SGLang's CPU engine and
HiCache host pool call, each with the semantics SGLang documents for it.

SGLang's CPU build of `sgl_kernel` (its C++/AVX-512 kernels) is not on the
package index; the CUDA wheels that are do not load beside a CPU torch. These
functions take the same arguments as the ops they stand in for and do the
same copies with plain tensor indexing. They are correct, not fast: a CPU
test and bench engine, never a serving path on GPUs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch


def _long(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(device="cpu", dtype=torch.int64).reshape(-1)


def _rows_at(address: int, rows: int, row_bytes: int) -> torch.Tensor:
    """The `rows` x `row_bytes` bytes at `address` as a uint8 tensor (no copy)."""
    raw = (ctypes.c_uint8 * (rows * row_bytes)).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer b (base address `data_ptrs[b]`, rows of `strides[b]`
    bytes), copy row `src_loc[i]` to row `tgt_loc[i]`. All rows are read before
    any is written, so overlapping moves are safe (SGLang's in-place contract)."""
    src, tgt = _long(src_loc), _long(tgt_loc)
    if src.numel() != tgt.numel():
        raise ValueError(f"{src.numel()} source rows for {tgt.numel()} targets")
    if src.numel() == 0:
        return
    if bool((src < 0).any()) or bool((tgt < 0).any()):
        raise ValueError("KV cache row indices must be non-negative")
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        buffer = _rows_at(int(address), rows, int(row_bytes))
        buffer[tgt] = buffer[src].clone()


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Request i's token slots [start_i, end_i) in its row `req_pool_indices[i]`
    of `req_to_token` take the next `end_i - start_i` entries of `out_cache_loc`
    (requests' runs laid end to end in batch order)."""
    if req_to_token.size(1) != pool_len:
        raise ValueError(f"req_to_token rows hold {req_to_token.size(1)} slots, not {pool_len}")
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), starts, ends, strict=True):
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"token range [{start}, {end}) outside a row of {pool_len}")
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n
    if offset > out_cache_loc.numel():
        raise ValueError(f"{offset} slots assigned from {out_cache_loc.numel()} cache locations")


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Token-slot copy per buffer: `dst_layers[j][dst_indices] = src_layers[j][src_indices]`
    (layer_first host pools <-> device pools; slots come in whole pages)."""
    src, dst = _long(src_indices), _long(dst_indices)
    _check_pages(src, dst, page_size)
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source buffers for {len(dst_layers)} targets")
    for s, d in zip(src_layers, dst_layers, strict=True):
        d.index_copy_(0, dst.to(d.device), s.index_select(0, src.to(s.device)).to(d.device))


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """page_first_direct host -> one device layer: host slot h is
    `src[h // page_size, layer_id, h % page_size]`, written to `dst[dst_index]`."""
    src, dst = _long(src_indices), _long(dst_indices)
    _check_pages(src, dst, page_size)
    for s, d in zip(src_ptrs, dst_ptrs, strict=True):
        rows = s[src // page_size, layer_id, src % page_size]
        d.index_copy_(0, dst.to(d.device), rows.to(d.device))


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Every device layer -> page_first_direct host buffers: `src_ptrs` holds
    each destination's layers in turn (K layers then V layers for MHA); device
    slot `src_indices[i]` of layer l goes to `dst[h // page_size, l, h % page_size]`
    for h = `dst_indices[i]`."""
    src, dst = _long(src_indices), _long(dst_indices)
    _check_pages(src, dst, page_size)
    if not dst_ptrs or len(src_ptrs) % len(dst_ptrs):
        raise ValueError(f"{len(src_ptrs)} device layers for {len(dst_ptrs)} host buffers")
    layers = len(src_ptrs) // len(dst_ptrs)
    for j, d in enumerate(dst_ptrs):
        if d.size(1) < layers:
            raise ValueError(f"host buffer of {d.size(1)} layers for {layers} device layers")
        page, slot = dst // page_size, dst % page_size
        for layer in range(layers):
            s = src_ptrs[j * layers + layer]
            d[page, layer, slot] = s.index_select(0, src.to(s.device)).to(d.device)


def _check_pages(src: torch.Tensor, dst: torch.Tensor, page_size: int) -> None:
    if src.numel() != dst.numel():
        raise ValueError(f"{src.numel()} source slots for {dst.numel()} targets")
    if page_size <= 0 or src.numel() % page_size:
        raise ValueError(f"{src.numel()} slots are not whole pages of {page_size}")
