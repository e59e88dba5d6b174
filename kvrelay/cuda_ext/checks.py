"""Argument checks for the Python implementations of gather/scatter_pages.

They mirror the checks of the compiled module (csrc/bindings.cpp) so every
backend rejects the same calls with the same exception types: TypeError for a
dtype, ValueError for a shape or layout, IndexError for anything out of range.
Without them the numba path would read and write outside its arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True, slots=True)
class CopyGeometry:
    """Byte geometry of a validated call."""

    num_slots: int
    pool_heads: int
    page_size: int
    k_row_bytes: int
    v_row_bytes: int


def _check_layers(layers, name: str, like: torch.Tensor) -> tuple[int, ...]:
    geometry = None
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name}[{i}] must be [num_slots, heads, head_dim], got {t.dim()} dims"
            )
        if t.dtype != like.dtype:
            raise TypeError(
                f"{name}[{i}] has dtype {t.dtype}, expected {like.dtype} "
                "(all K and V layers share one KV dtype)"
            )
        if t.device != like.device:
            raise ValueError(f"{name}[{i}] is on {t.device}, expected {like.device}")
        if t.size(2) != 0 and t.stride(2) != 1:
            raise ValueError(
                f"{name}[{i}] must be contiguous in head_dim (stride 1), got stride {t.stride(2)}"
            )
        es = t.element_size()
        this = (t.size(0), t.size(1), t.size(2) * es, t.stride(0) * es, t.stride(1) * es)
        if geometry is None:
            geometry = this
        elif this != geometry:
            raise ValueError(f"{name}[{i}] has shape/strides unlike {name}[0]")
    return geometry


class CopyArgs(NamedTuple):
    """The arguments of gather_pages / scatter_pages, in kvrelay._C's order."""

    k_layers: Sequence[torch.Tensor]
    v_layers: Sequence[torch.Tensor]
    pages: torch.Tensor
    page_ids: torch.Tensor
    slot_mapping: torch.Tensor
    page_heads: int
    page_layers: int
    page_head_start: int
    page_layer_start: int
    pool_head_start: int
    num_heads: int


def check_copy_args(args: CopyArgs, *, gather: bool) -> CopyGeometry:
    """Raise unless the call is well formed; return its byte geometry."""
    (k_layers, v_layers, pages, page_ids, slot_mapping, page_heads, page_layers,
     page_head_start, page_layer_start, pool_head_start, num_heads) = args  # fmt: skip
    if len(k_layers) == 0:
        raise ValueError("k_layers is empty: pass one K tensor per layer")
    first = k_layers[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError("k_layers[0] must be a tensor")
    num_slots, pool_heads, k_row, _, _ = _check_layers(k_layers, "k_layers", first)
    v_row = 0
    if len(v_layers):
        if len(v_layers) != len(k_layers):
            raise ValueError(
                f"v_layers has {len(v_layers)} layers but k_layers has {len(k_layers)} "
                "(pass [] for MLA)"
            )
        v_slots, v_heads, v_row, _, _ = _check_layers(v_layers, "v_layers", first)
        if (v_slots, v_heads) != (num_slots, pool_heads):
            raise ValueError("v_layers and k_layers differ in slots or heads")
    num_pages, page_size = _check_index_tensors(pages, page_ids, slot_mapping, first.device)
    if page_heads <= 0 or page_layers <= 0:
        raise ValueError("page_heads and page_layers must be positive")
    if num_heads <= 0:
        raise ValueError("num_heads must be positive")
    if not 0 <= page_head_start <= page_heads - num_heads:
        raise IndexError(
            f"heads [{page_head_start}, {page_head_start + num_heads}) outside a page object "
            f"of {page_heads} heads"
        )
    if not 0 <= page_layer_start <= page_layers - len(k_layers):
        raise IndexError(
            f"layers [{page_layer_start}, {page_layer_start + len(k_layers)}) outside a page "
            f"object of {page_layers} layers"
        )
    if not 0 <= pool_head_start <= pool_heads - num_heads:
        raise IndexError(
            f"pool heads [{pool_head_start}, {pool_head_start + num_heads}) outside a pool of "
            f"{pool_heads} heads"
        )
    page_bytes = page_heads * page_layers * page_size * (k_row + v_row)
    if pages.size(1) != page_bytes:
        raise ValueError(
            f"pages rows are {pages.size(1)} bytes but a page object of {page_heads} heads x "
            f"{page_layers} layers x {page_size} tokens x {k_row + v_row} bytes/token "
            f"is {page_bytes}"
        )
    if num_pages:
        _check_ids(pages, page_ids, slot_mapping, num_slots, gather)
    return CopyGeometry(num_slots, pool_heads, page_size, k_row, v_row)


def _check_index_tensors(pages, page_ids, slot_mapping, device) -> tuple[int, int]:
    """The arena and index tensors' dtypes, shapes and device; returns
    (pages to copy, tokens per page)."""
    if pages.dtype != torch.uint8:
        raise TypeError(f"pages must be uint8 (page objects are bytes), got {pages.dtype}")
    if pages.dim() != 2:
        raise ValueError(f"pages must be [num_arena_pages, page_bytes], got {pages.dim()} dims")
    if pages.device != device:
        raise ValueError(f"pages is on {pages.device}, pool on {device}")
    if pages.size(1) != 0 and pages.stride(1) != 1:
        raise ValueError("pages rows must be contiguous (stride 1 in dim 1)")
    if page_ids.dtype != torch.int64:
        raise TypeError(f"page_ids must be int64, got {page_ids.dtype}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if page_ids.dim() != 1 or not page_ids.is_contiguous():
        raise ValueError("page_ids must be a contiguous 1-D tensor")
    if slot_mapping.dim() != 2 or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be a contiguous [num_pages, page_size] tensor")
    if page_ids.device != device or slot_mapping.device != device:
        raise ValueError(f"page_ids and slot_mapping must be on the pool's device {device}")
    num_pages, page_size = page_ids.size(0), slot_mapping.size(1)
    if slot_mapping.size(0) != num_pages:
        raise ValueError(
            f"slot_mapping has {slot_mapping.size(0)} pages but page_ids has {num_pages}"
        )
    if page_size <= 0:
        raise ValueError("page_size (slot_mapping.size(1)) must be positive")
    return num_pages, page_size


def _check_ids(pages, page_ids, slot_mapping, num_slots: int, gather: bool) -> None:
    """Every page id inside the arena, every slot inside the pool, and no two
    writes to one destination."""
    if int(page_ids.min()) < 0 or int(page_ids.max()) >= pages.size(0):
        raise IndexError(f"page_ids must lie in [0, {pages.size(0)})")
    if int(slot_mapping.min()) < -1 or int(slot_mapping.max()) >= num_slots:
        raise IndexError(f"slot_mapping values must lie in [-1, {num_slots})")
    if gather:
        if page_ids.unique().numel() != page_ids.numel():
            raise ValueError("page_ids has duplicates: two pages would be written to one arena row")
    else:
        valid = slot_mapping[slot_mapping >= 0]
        if valid.unique().numel() != valid.numel():
            raise ValueError(
                "slot_mapping has duplicate slots: two tokens would be written to one slot"
            )


def copy_ops(
    run: Callable[[bool, CopyArgs], None],
) -> tuple[Callable[..., None], Callable[..., None]]:
    """gather_pages and scatter_pages taking kvrelay._C's arguments (positional
    or by name), around `run(gather, args)` of a Python implementation."""

    def gather_pages(*args, **kwargs) -> None:
        """Pool -> page objects (see kvrelay.cuda_ext.gather_pages)."""
        run(True, CopyArgs(*args, **kwargs))

    def scatter_pages(*args, **kwargs) -> None:
        """Page objects -> pool (see kvrelay.cuda_ext.scatter_pages)."""
        run(False, CopyArgs(*args, **kwargs))

    return gather_pages, scatter_pages
