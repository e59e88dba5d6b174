"""Page copies between a `LatentKVPool` and arena rows of unified pages.

An MLA page has one head, so a rank's rectangle is its stage's layers: one
contiguous byte run. Each layer's block is its latent rows (kv dtype) and,
where the layer's indexer runs, its indexer keys (index dtype) right after
(`ModelKVSpec.layer_offset`). The copy is one indexed read and one indexed
write per layer and part, vectorised over the request's pages; tokens with
slot -1 are zeros on gather and skipped on scatter, as the multi-head ops do.
The arena and pool may live on different devices: the rows travel as one
tensor per layer and part.
"""

from __future__ import annotations

import torch

from kvrelay.layout import LayoutError, ModelKVSpec, Rectangle
from kvrelay.model.device import synchronize
from kvrelay.model.latent_pool import LatentKVPool


def _parts(pool: LatentKVPool, spec: ModelKVSpec, rect: Rectangle):
    """(pool tensor [slots, width], byte offset in the page, width, dtype) of
    each latent and indexer part of the rectangle's layers."""
    _check(pool, spec, rect)
    for layer in range(rect.layer_start, rect.layer_end):
        local = layer - rect.layer_start
        offset = spec.layer_offset(layer)
        yield pool.latent_layers[local], offset, spec.k_head_dim
        keys = pool.index_keys[local]
        if keys is not None:
            yield keys, offset + spec.page_size * spec.k_row_bytes, spec.index_head_dim


def _check(pool: LatentKVPool, spec: ModelKVSpec, rect: Rectangle) -> None:
    rect.check_inside(spec)
    if spec.attention_kind != "mla":
        raise LayoutError("a latent pool holds MLA pages")
    if pool.num_layers != rect.num_layers or pool.latent_dim != spec.k_head_dim:
        raise LayoutError(
            f"pool of {pool.num_layers} layers x {pool.latent_dim} does not hold "
            f"rectangle {rect} of a page of {spec.k_head_dim}-wide latents"
        )
    want = tuple(layer - rect.layer_start for layer in spec.index_layers if rect.layer_start
                 <= layer < rect.layer_end)  # fmt: skip
    if pool.index_local_layers != want or (want and pool.index_dim != spec.index_head_dim):
        raise LayoutError(
            f"pool indexer layers {pool.index_local_layers} (x{pool.index_dim}) are not the "
            f"page's {want} (x{spec.index_head_dim})"
        )


def gather_latent_rect(
    pool: LatentKVPool,
    arena: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    spec: ModelKVSpec,
    rect: Rectangle,
) -> None:
    """The pool rows of `slots` ([pages, page_size], -1 for none) into `rect`
    of arena rows `rows`."""
    dev = pool.device
    slots = slots.to(dev)
    missing = slots < 0
    safe = slots.clamp(min=0)
    rows = rows.to(arena.device)
    pages = slots.size(0)
    for tensor, offset, _ in _parts(pool, spec, rect):
        values = tensor[safe].masked_fill(missing[..., None], 0)  # [pages, ps, width]
        raw = values.contiguous().view(torch.uint8).reshape(pages, -1)
        arena[rows, offset : offset + raw.size(1)] = raw.to(arena.device)
    synchronize(dev)


def scatter_latent_rect(
    pool: LatentKVPool,
    arena: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    spec: ModelKVSpec,
    rect: Rectangle,
) -> None:
    """`rect` of arena rows `rows` into the pool slots `slots` (-1 skipped)."""
    dev = pool.device
    slots = slots.to(dev)
    present = slots >= 0
    targets = slots[present]
    rows = rows.to(arena.device)
    ps = spec.page_size
    for tensor, offset, width in _parts(pool, spec, rect):
        length = ps * width * tensor.element_size()
        raw = arena[rows, offset : offset + length].to(dev)
        values = raw.view(tensor.dtype).view(-1, ps, width)
        tensor[targets] = values[present]
    synchronize(dev)
