"""Page copies between a rank's KV pool and an arena of unified page rows, on
whatever device each lives.

The pool and a staging arena on one device (both CPU, or both one GPU): one
`gather_pages` / `scatter_pages` call, the compiled CPU op or the CUDA kernel
launched on the current stream. A GPU pool with a host arena (`--staging
pinned`, or the shared arena of `ParallelEngine.export_prefix`): the kernel
fills a GPU bounce buffer, one DMA moves it to (or from) a page-locked host
buffer, and only this rank's rectangle runs are copied between that and the
arena rows, so other ranks' rectangles of a shared row are never
overwritten. Either way the copy has landed when these return (the stream
is synchronised), so a handle may be published, a page committed to the
tier, or a staging row reused right after.
"""

from __future__ import annotations

import torch

from kvrelay.cuda_ext import gather_pages, rect_geometry, scatter_pages
from kvrelay.layout import ModelKVSpec, Rectangle
from kvrelay.model.device import synchronize
from kvrelay.model.latent_page_copy import gather_latent_rect, scatter_latent_rect
from kvrelay.model.latent_pool import LatentKVPool
from kvrelay.model.pool import PagedKVPool


def gather_rect(pool: PagedKVPool | LatentKVPool, arena: torch.Tensor, rows: torch.Tensor,
                slots: torch.Tensor, spec: ModelKVSpec, rect: Rectangle) -> None:  # fmt: skip
    """The pool KV of `slots` ([pages, page_size], -1 for none) into `rect` of
    arena rows `rows`."""
    _copy_rect(gather_pages, gather_through_bounce, pool, arena, rows, slots, spec, rect)


def scatter_rect(pool: PagedKVPool | LatentKVPool, arena: torch.Tensor, rows: torch.Tensor,
                 slots: torch.Tensor, spec: ModelKVSpec, rect: Rectangle) -> None:  # fmt: skip
    """`rect` of arena rows `rows` into the pool slots `slots` (-1 skipped)."""
    _copy_rect(scatter_pages, scatter_through_bounce, pool, arena, rows, slots, spec, rect)


def _copy_rect(op, through_bounce, pool, arena, rows, slots, spec, rect) -> None:
    """`op` straight between pool and arena when both are on one device, else
    `through_bounce`; returns once the copy is done. An MLA pool's pages have
    per-layer blocks of their own sizes (`latent_page_copy`)."""
    if isinstance(pool, LatentKVPool):
        latent_op = gather_latent_rect if op is gather_pages else scatter_latent_rect
        latent_op(pool, arena, rows, slots, spec, rect)
        return
    dev = pool.device
    if arena.device == dev:
        geometry = rect_geometry(spec, rect)
        op(pool.k_layers, pool.v_layers, arena, rows.to(dev), slots.to(dev), **geometry)
    else:
        through_bounce(pool, arena, rows, slots, spec, rect)
    synchronize(dev)


# The bounce paths serve a GPU pool and a host arena; they are written for any
# pair of devices, so the CPU suite runs them too (pool and arena both on the
# CPU, the bounce buffer then a plain host tensor).
def gather_through_bounce(pool, arena, rows, slots, spec, rect) -> None:
    dev = pool.device
    bounce = torch.empty(rows.numel(), arena.size(1), dtype=torch.uint8, device=dev)
    order = torch.arange(rows.numel(), dtype=torch.int64, device=dev)
    geometry = rect_geometry(spec, rect)
    gather_pages(pool.k_layers, pool.v_layers, bounce, order, slots.to(dev), **geometry)
    host = _host_buffer(bounce.shape, dev)
    host.copy_(bounce)
    rows = rows.to(arena.device)
    for offset, length in rect.byte_runs(spec):
        arena[rows, offset : offset + length] = host[:, offset : offset + length]


def scatter_through_bounce(pool, arena, rows, slots, spec, rect) -> None:
    dev = pool.device
    host = _host_buffer((rows.numel(), arena.size(1)), dev)
    host_rows = rows.to(arena.device)
    for offset, length in rect.byte_runs(spec):
        host[:, offset : offset + length] = arena[host_rows, offset : offset + length]
    bounce = host.to(dev)
    order = torch.arange(rows.numel(), dtype=torch.int64, device=dev)
    geometry = rect_geometry(spec, rect)
    scatter_pages(pool.k_layers, pool.v_layers, bounce, order, slots.to(dev), **geometry)


def _host_buffer(shape, device: torch.device) -> torch.Tensor:
    """A host buffer for copies to or from `device`: page-locked beside a GPU
    (torch caches these allocations), so the copy across PCIe is one DMA."""
    return torch.zeros(shape, dtype=torch.uint8, pin_memory=device.type == "cuda")
