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


# -- HiCache's `kernel` io backend ---------------------------------------------------
# Each op moves token rows of `item_size` bytes (one token's heads of one
# layer) between device layers and host buffers. A device layer is addressed
# by its base (a tensor, or an entry of a uint64 address table) plus
# index x item_size. Host buffers are laid out as
#   layer_first: per layer, index x item_size (like a device layer);
#   page_first:  [slot][layer] rows, index x layout_dim + layer x item_size;
#   page_head:   [page][head][token in page][layer][head bytes].
# A negative index skips its row (SGLang's padding), except in page_head ops.


def _byte_rows(tensor: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """A contiguous tensor's bytes as rows of `row_bytes` (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("the kernel io stand-ins address contiguous buffers only")
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel() % row_bytes:
        raise ValueError(f"a buffer of {flat.numel()} bytes is not rows of {row_bytes}")
    return flat.view(-1, row_bytes)


def _pairs(src_indices: torch.Tensor, dst_indices: torch.Tensor, *, skip_negative: bool):
    src, dst = _long(src_indices), _long(dst_indices)
    if src.numel() != dst.numel():
        raise ValueError(f"{src.numel()} source rows for {dst.numel()} targets")
    if skip_negative:
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep], dst[keep]
    elif src.numel() and (bool((src < 0).any()) or bool((dst < 0).any())):
        raise ValueError("page_head transfers take no negative indices")
    return src, dst


def _table_rows(table: torch.Tensor, layer: int, indices: torch.Tensor, item_size: int):
    """Rows of layer `layer` of an address table, enough to hold `indices`."""
    rows = int(indices.max()) + 1 if indices.numel() else 1
    return _rows_at(int(table[layer]), rows, item_size)


def _check_item(item_size: int, layout_dim: int | None = None, head_num: int = 1) -> None:
    if item_size <= 0 or item_size % head_num:
        raise ValueError(f"item_size {item_size} is not whole rows of {head_num} heads")
    if layout_dim is not None and (layout_dim <= 0 or layout_dim % item_size):
        raise ValueError(f"layout_dim {layout_dim} is not whole layers of {item_size} bytes")


def _page_first_layer(buffer: torch.Tensor, layer: int, item_size: int, layout_dim: int):
    """Layer `layer`'s rows of a page_first host buffer: [slot, item_size] bytes."""
    return _byte_rows(buffer, layout_dim).view(-1, layout_dim // item_size, item_size)[:, layer]


def _page_head_view(buffer, item_size: int, layout_dim: int, page_size: int, head_num: int):
    """A page_head host buffer as [page, head, token, layer, head bytes]."""
    head_bytes = item_size // head_num
    layers = layout_dim // item_size
    return _byte_rows(buffer, page_size * layout_dim).view(
        -1, head_num, page_size, layers, head_bytes
    )


def _copy_rows(src_rows: torch.Tensor, dst_rows: torch.Tensor, src, dst) -> None:
    dst_rows[dst] = src_rows[src]


def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size,
                          block_quota=2, num_warps_per_block=32):  # fmt: skip
    """One layer, layer_first host <-> device: `dst[d] = src[s]` row by row."""
    _check_item(item_size)
    src, dst = _pairs(src_indices, dst_indices, skip_negative=True)
    for s, d in ((src_k, dst_k), (src_v, dst_v)):
        _copy_rows(_byte_rows(s, item_size), _byte_rows(d, item_size), src, dst)


def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id,
                                item_size, src_layout_dim, block_quota=2,
                                num_warps_per_block=32):  # fmt: skip
    """page_first host buffers -> one device layer (`layer_id`)."""
    _check_item(item_size, src_layout_dim)
    src, dst = _pairs(src_indices, dst_indices, skip_negative=True)
    for s, d in ((src_k, dst_k), (src_v, dst_v)):
        rows = _page_first_layer(s, layer_id, item_size, src_layout_dim)
        _copy_rows(rows, _byte_rows(d, item_size), src, dst)


def transfer_kv_per_layer_ph_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id,
                                item_size, src_layout_dim, page_size, head_num, block_quota=2,
                                num_warps_per_block=32):  # fmt: skip
    """page_head host buffers -> one device layer (`layer_id`)."""
    _check_item(item_size, src_layout_dim, head_num)
    src, dst = _pairs(src_indices, dst_indices, skip_negative=False)
    for s, d in ((src_k, dst_k), (src_v, dst_v)):
        view = _page_head_view(s, item_size, src_layout_dim, page_size, head_num)
        rows = view[src // page_size, :, src % page_size, layer_id]  # [n, head, head bytes]
        _byte_rows(d, item_size)[dst] = rows.reshape(-1, item_size)


def transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices,
                          dst_indices, item_size, num_layers, block_quota=2,
                          num_warps_per_block=32):  # fmt: skip
    """Every layer, between two address tables (device <-> layer_first host)."""
    _check_item(item_size)
    _check_tables(num_layers, src_k_layers, dst_k_layers, src_v_layers, dst_v_layers)
    src, dst = _pairs(src_indices, dst_indices, skip_negative=True)
    for layer in range(num_layers):
        for s, d in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
            rows_in = _table_rows(s, layer, src, item_size)
            _copy_rows(rows_in, _table_rows(d, layer, dst, item_size), src, dst)


def transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices,
                                dst_indices, item_size, dst_layout_dim, num_layers,
                                block_quota=2, num_warps_per_block=32):  # fmt: skip
    """Every device layer (address tables) -> page_first host buffers."""
    _check_item(item_size, dst_layout_dim)
    _check_tables(num_layers, src_k_layers, src_v_layers)
    src, dst = _pairs(src_indices, dst_indices, skip_negative=True)
    for layer in range(num_layers):
        for s, d in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
            rows_out = _page_first_layer(d, layer, item_size, dst_layout_dim)
            _copy_rows(_table_rows(s, layer, src, item_size), rows_out, src, dst)


def transfer_kv_all_layer_lf_ph(src_k_layers, dst_k, src_v_layers, dst_v, src_indices,
                                dst_indices, item_size, dst_layout_dim, num_layers, page_size,
                                head_num, block_quota=2, num_warps_per_block=32):  # fmt: skip
    """Every device layer (address tables) -> page_head host buffers."""
    _check_item(item_size, dst_layout_dim, head_num)
    _check_tables(num_layers, src_k_layers, src_v_layers)
    src, dst = _pairs(src_indices, dst_indices, skip_negative=False)
    page, token = dst // page_size, dst % page_size
    for s, d in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        view = _page_head_view(d, item_size, dst_layout_dim, page_size, head_num)
        for layer in range(num_layers):
            rows = _table_rows(s, layer, src, item_size)[src]
            view[page, :, token, layer] = rows.view(-1, head_num, item_size // head_num)


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, block_quota=2,
                              num_warps_per_block=32):  # fmt: skip
    """MLA, one layer, layer_first host <-> device (one latent row per token)."""
    _check_item(item_size)
    s, d = _pairs(src_indices, dst_indices, skip_negative=True)
    _copy_rows(_byte_rows(src, item_size), _byte_rows(dst, item_size), s, d)


def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size,
                                    src_layout_dim, block_quota=2,
                                    num_warps_per_block=32):  # fmt: skip
    """MLA page_first host buffer -> one device layer (`layer_id`)."""
    _check_item(item_size, src_layout_dim)
    s, d = _pairs(src_indices, dst_indices, skip_negative=True)
    rows = _page_first_layer(src, layer_id, item_size, src_layout_dim)
    _copy_rows(rows, _byte_rows(dst, item_size), s, d)


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size,
                              num_layers, block_quota=2, num_warps_per_block=32):  # fmt: skip
    """MLA, every layer, between two address tables."""
    _check_item(item_size)
    _check_tables(num_layers, src_layers, dst_layers)
    s, d = _pairs(src_indices, dst_indices, skip_negative=True)
    for layer in range(num_layers):
        rows_in = _table_rows(src_layers, layer, s, item_size)
        _copy_rows(rows_in, _table_rows(dst_layers, layer, d, item_size), s, d)


def transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size,
                                    dst_layout_dim, num_layers, block_quota=2,
                                    num_warps_per_block=32):  # fmt: skip
    """MLA, every device layer (address table) -> a page_first host buffer."""
    _check_item(item_size, dst_layout_dim)
    _check_tables(num_layers, src_layers)
    s, d = _pairs(src_indices, dst_indices, skip_negative=True)
    for layer in range(num_layers):
        rows_out = _page_first_layer(dst, layer, item_size, dst_layout_dim)
        _copy_rows(_table_rows(src_layers, layer, s, item_size), rows_out, s, d)


def _check_tables(num_layers: int, *tables: torch.Tensor) -> None:
    for table in tables:
        if table.dtype != torch.uint64 or table.numel() != num_layers:
            raise ValueError(f"an address table of {table.numel()} {table.dtype} entries "
                             f"for {num_layers} layers")  # fmt: skip
