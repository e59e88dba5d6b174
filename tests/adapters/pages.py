"""The test's own reading of SGLang's host layouts: where each (kv, layer, token,
head, dim) element of a page sits, from the dims of SGLang's `init_kv_buffer`,
reached through SGLang's `get_data_page(flat=False)` views."""

from __future__ import annotations

import torch

# Axes of SGLang's non-flat data page view per layout (the singleton page axis
# of the page-block layouts dropped).
MHA_AXES = {
    "layer_first": ("kv", "layer", "token", "head", "dim"),
    "page_first": ("kv", "token", "layer", "head", "dim"),
    "page_first_direct": ("kv", "layer", "token", "head", "dim"),
    "page_head": ("kv", "head", "token", "layer", "dim"),
}
MLA_AXES = {
    "layer_first": ("layer", "token", "head", "dim"),
    "page_first": ("token", "layer", "head", "dim"),
    "page_first_direct": ("layer", "token", "head", "dim"),
}
CANON_MHA = ("kv", "layer", "token", "head", "dim")
CANON_MLA = ("layer", "token", "head", "dim")


def _page_view(pool, index: int) -> tuple[torch.Tensor, tuple[str, ...]]:
    mla = hasattr(pool, "kv_cache_dim")
    if pool.layout == "page_unified":
        page = pool.kv_buffer[index // pool.page_size]
        if mla:  # (layer, token, dim)
            return page.unsqueeze(2), CANON_MLA
        # (group, layer, kv, token, head in group, dim) -> heads merged below
        merged = page.permute(2, 1, 3, 0, 4, 5)  # kv, layer, token, group, hig, dim
        return merged, ("kv", "layer", "token", "group", "hig", "dim")
    view = pool.get_data_page(index, flat=False)
    if pool.layout in ("page_first_direct", "page_head"):
        view = view[0] if mla else view[:, 0]
    return view, (MLA_AXES if mla else MHA_AXES)[pool.layout]


def _canonical(view, axes):
    if "group" in axes:  # kv, layer, token, group, hig, dim: merge the heads (a copy)
        return view.reshape(*view.shape[:3], -1, view.shape[-1])
    canon = CANON_MLA if len(axes) == 4 else CANON_MHA
    return view.permute([axes.index(a) for a in canon])


def write_page(pool, index: int, local: torch.Tensor) -> None:
    """Put `local` ([kv,] layer, token, head, dim of this rank) into host page `index`."""
    view, axes = _page_view(pool, index)
    if "group" in axes:
        view.copy_(local.reshape(view.shape))
    else:
        _canonical(view, axes).copy_(local)


def read_page(pool, index: int) -> torch.Tensor:
    view, axes = _page_view(pool, index)
    return _canonical(view, axes).clone()
