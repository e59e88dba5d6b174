"""Move one rank's rectangle between an SGLang host pool and unified pages.

A rank's share of a unified page, held compactly (its heads x its layers), is

    MHA: [head][layer][K, V][token][head_dim]      MLA: [layer][token][latent]

which is kvrelay's page[head][layer] = K[token] ++ V[token] restricted to the
rectangle. SGLang's host layouts relate to it as follows:

* `page_unified` (MHA with one head per group, and MLA) and MLA's
  `page_first_direct` store each host page in exactly that byte order: the host
  pool itself is registered with the transfer agent and pages move into and out
  of it with no copy (`zero_copy`).
* `layer_first` and `page_first` address KV by token slot, one [slot, head,
  dim] view per layer: the compiled gather/scatter ops (kvrelay.cuda_ext) move
  them to and from a staging arena.
* `page_first_direct` and `page_head` (MHA) and `page_unified` with several
  heads per group keep a page contiguous but in another axis order: a strided
  torch copy permutes whole pages to and from the staging arena.

The plain (non-zero-copy) interface hands over flat pages in the order of
SGLang's `get_data_page`; `flat_to_compact` / `compact_to_flat` convert them.
"""

from __future__ import annotations

import torch

from kvrelay.adapters.sglang.identity import (
    PoolGeometry,
    UnsupportedPool,
    rope_to_pairs,
    rope_to_unified,
)
from kvrelay.cuda_ext import gather_pages, scatter_pages

TOKEN_LAYOUTS = ("layer_first", "page_first")
MHA_TARGET = ("head", "layer", "kv", "token", "dim")
MHA_GROUPED_TARGET = ("group", "hig", "layer", "kv", "token", "dim")
MLA_TARGET = ("layer", "token", "dim")


def _mha_buffer_axes(layout: str) -> tuple[str, ...] | None:
    return {
        "page_first_direct": ("kv", "page", "layer", "token", "head", "dim"),
        "page_head": ("kv", "page", "head", "token", "layer", "dim"),
        "page_unified": ("page", "group", "layer", "kv", "token", "hig", "dim"),
    }.get(layout)


def _flat_axes(g: PoolGeometry, layer_num: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Shape and axes of one page as SGLang's get_data_page flattens it."""
    p, h, d = g.page_size, g.local_heads, g.k_head_dim
    table = {
        ("mha", "layer_first"): ((2, layer_num, p, h, d), ("kv", "layer", "token", "head", "dim")),
        ("mha", "page_first"): ((2, p, layer_num, h, d), ("kv", "token", "layer", "head", "dim")),
        ("mha", "page_first_direct"): (
            (2, layer_num, p, h, d), ("kv", "layer", "token", "head", "dim")),
        ("mha", "page_head"): ((2, h, p, layer_num, d), ("kv", "head", "token", "layer", "dim")),
        ("mla", "layer_first"): ((layer_num, p, d), ("layer", "token", "dim")),
        ("mla", "page_first"): ((p, layer_num, d), ("token", "layer", "dim")),
        ("mla", "page_first_direct"): ((layer_num, p, d), ("layer", "token", "dim")),
    }  # fmt: skip
    if (g.attention_kind, g.layout) not in table:
        raise UnsupportedPool(f"SGLang has no flat {g.attention_kind} pages for {g.layout!r}")
    return table[(g.attention_kind, g.layout)]


def _permuted(src: torch.Tensor, axes: tuple[str, ...], target: tuple[str, ...], layers: int):
    """`src` (named `axes`) narrowed to the first `layers` layers, in `target` order."""
    src = src.narrow(axes.index("layer"), 0, layers)
    return src.permute([axes.index(a) for a in target])


class PoolMover:
    """One rank's host pool seen as compact rectangles of unified pages."""

    def __init__(self, pool, geometry: PoolGeometry, rect_bytes: int) -> None:
        g = geometry
        self.pool, self.geometry, self.rect_bytes = pool, g, rect_bytes
        self.page_size = g.page_size
        self.layer_num = int(pool.layer_num)  # includes packed draft layers, if any
        buffer = pool.kv_buffer
        if g.attention_kind == "mla":
            self.target = MLA_TARGET
            self.target_shape = (g.local_layers, g.page_size, g.k_head_dim)
            self._buffer_axes = ("page", "layer", "token", "dim")
            self._paged = g.layout in ("page_first_direct", "page_unified")
            self._view = (
                buffer.view(buffer.size(0), self.layer_num, g.page_size, -1)
                if self._paged
                else buffer
            )
        else:
            grouped = g.layout == "page_unified"
            hig = g.heads_per_group
            self.target = MHA_GROUPED_TARGET if grouped else MHA_TARGET
            head_dims = (g.local_heads // hig, hig) if grouped else (g.local_heads,)
            self.target_shape = (*head_dims, g.local_layers, 2, g.page_size, g.k_head_dim)
            self._buffer_axes = _mha_buffer_axes(g.layout)
            self._paged = self._buffer_axes is not None
            self._view = buffer
        if not self._paged and g.layout not in TOKEN_LAYOUTS:
            raise UnsupportedPool(f"host layout {g.layout!r} is not supported")
        self._layers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # MLA rows whose RoPE part SGLang holds as interleaved pairs.
        self.rope = g.rope_head_dim if g.rope_pairs else 0
        # The pool's own bytes are unified pages: move them in place.
        self.zero_copy = (
            not self.rope
            and self._paged
            and self.layer_num == g.local_layers
            and (
                g.attention_kind == "mla" or (g.layout == "page_unified" and g.heads_per_group == 1)
            )
            and buffer.is_contiguous()
        )

    # -- host indices ----------------------------------------------------------
    def page_numbers(self, host_indices: torch.Tensor, count: int) -> torch.Tensor:
        """Host page number of each of `count` pages (token slots, page aligned)."""
        slots = host_indices.to(torch.int64).reshape(-1)
        if slots.numel() != count * self.page_size:
            raise ValueError(
                f"{slots.numel()} host indices for {count} pages of {self.page_size} tokens"
            )
        firsts = slots[:: self.page_size]
        if bool((firsts % self.page_size).any()):
            raise ValueError("host indices of a page must start on a page boundary")
        return firsts // self.page_size

    def zero_copy_offsets(self, pages: torch.Tensor) -> list[int]:
        """Byte offset of each host page inside the registered pool buffer."""
        return (pages * self.rect_bytes).tolist()

    # -- staged moves ------------------------------------------------------------
    def _compact(self, staging: torch.Tensor, n: int) -> torch.Tensor:
        return staging[:n].view(self.pool.dtype).view(n, *self.target_shape)

    def gather(self, host_indices: torch.Tensor, staging: torch.Tensor, n: int) -> None:
        """Host pages -> rows 0..n-1 of `staging` (uint8 [rows, rect_bytes])."""
        if self._paged:
            pages = self.page_numbers(host_indices, n)
            axes = self._buffer_axes
            src = self._view.index_select(axes.index("page"), pages)
            self._compact(staging, n).copy_(
                _permuted(src, axes, ("page", *self.target), self.geometry.local_layers)
            )
        else:
            k, v = self.token_layers()
            slots = host_indices.to(torch.int64).reshape(n, self.page_size).contiguous()
            gather_pages(k, v, staging, torch.arange(n), slots, **self._op_geometry())
        if self.rope:
            rope_to_unified(self._compact(staging, n), self.rope)

    def scatter(self, staging: torch.Tensor, host_indices: torch.Tensor, n: int) -> None:
        """Rows 0..n-1 of `staging` -> host pages."""
        if self.rope:  # `staging` stays as it is (read-ahead rows are read again)
            staging = staging[:n].clone()
            rope_to_pairs(self._compact(staging, n), self.rope)
        if self._paged:
            pages = self.page_numbers(host_indices, n)
            axes = self._buffer_axes
            layer_axis = axes.index("layer")
            dest = self._view.narrow(layer_axis, 0, self.geometry.local_layers)
            order = ("page", *self.target)
            src = self._compact(staging, n).permute([order.index(a) for a in axes])
            dest.index_copy_(axes.index("page"), pages, src)
            return
        k, v = self.token_layers()
        slots = host_indices.to(torch.int64).reshape(n, self.page_size).contiguous()
        scatter_pages(k, v, staging, torch.arange(n), slots, **self._op_geometry())

    def token_layers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One [slot, head, dim] view per target layer, K then V (none for MLA),
        made once: the pool's buffer is the same for the backend's life."""
        if self._layers is None:
            self._layers = self._make_token_layers()
        return self._layers

    def _make_token_layers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        buffer, layers = self.pool.kv_buffer, range(self.geometry.local_layers)
        first = self.geometry.layout == "layer_first"
        if self.geometry.attention_kind == "mla":
            return [buffer[i] if first else buffer[:, i] for i in layers], []
        k, v = buffer[0], buffer[1]
        if first:
            return [k[i] for i in layers], [v[i] for i in layers]
        return [k[:, i] for i in layers], [v[:, i] for i in layers]

    def _op_geometry(self) -> dict[str, int]:
        g = self.geometry
        return {
            "page_heads": g.local_heads,
            "page_layers": g.local_layers,
            "page_head_start": 0,
            "page_layer_start": 0,
            "pool_head_start": 0,
            "num_heads": g.local_heads,
        }

    # -- flat pages of the plain interface ---------------------------------------------
    def flat_to_compact(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """A flat SGLang page (get_data_page order) -> `out` (uint8 [rect_bytes])."""
        shape, axes = _flat_axes(self.geometry, self.layer_num)
        src = flat.reshape(shape)
        target = self._flat_target()
        layers = self.geometry.local_layers
        sizes = [layers if a == "layer" else src.size(axes.index(a)) for a in target]
        dst = out.view(self.pool.dtype).view(sizes)
        dst.copy_(_permuted(src, axes, target, self.geometry.local_layers))
        if self.rope:
            rope_to_unified(dst, self.rope)

    def compact_to_flat(self, compact: torch.Tensor, flat: torch.Tensor) -> None:
        """`compact` (uint8 [rect_bytes]) -> a flat SGLang page, in get_data_page order."""
        shape, axes = _flat_axes(self.geometry, self.layer_num)
        dest = flat.view(shape).narrow(axes.index("layer"), 0, self.geometry.local_layers)
        target = self._flat_target()
        sizes = [dest.size(axes.index(a)) for a in target]
        src = compact.view(self.pool.dtype).view(sizes)
        if self.rope:
            src = src.clone()
            rope_to_pairs(src, self.rope)
        dest.copy_(src.permute([target.index(a) for a in axes]))

    def _flat_target(self) -> tuple[str, ...]:
        return MLA_TARGET if self.geometry.attention_kind == "mla" else MHA_TARGET
