"""The DSA indexer's top-k: each row's k largest scores, a tie across the
k-th score going to the earliest tokens.

`top_k` returns what `torch.topk(k).indices` returns for a row without such
a tie (the order included: sparse attention sums the selected rows in this
order), and for a row with one the tokens above the k-th score, then the
earliest at it, each in token order, so the choice never depends on how
long the scored row is (torch.topk breaks ties by its own internal order).

A third of a long prefill's rows are flat: more than k scores equal the
row's peak (zero, when every indexer head weighs a query negatively), so
the choice is the first k tokens at the peak, found in the row's first few
k scores. They skip torch.topk, which is most of the indexer's cost.
"""

from __future__ import annotations

import torch

# Scores of a row searched for its first k tokens at the peak, in multiples
# of k (ties at zero are about a quarter of a row and more).
FLAT_PREFIX = 8


def top_k(summed: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [rows, k] positions of each row's k largest scores (see the module)."""
    peak = summed.amax(-1, keepdim=True)
    at_peak = torch.eq(summed[:, : FLAT_PREFIX * k], peak)
    # Counted as bytes into int32: a bool sum widens every element to int64.
    flat = at_peak.view(torch.uint8).sum(-1, dtype=torch.int32) > k
    flat &= torch.isfinite(peak[:, 0])  # as the plain way: no canonical order at +-inf
    if not bool(flat.any()):
        return _whole_top(summed, k)
    out = torch.empty(summed.size(0), k, dtype=torch.int64, device=summed.device)
    rows = flat.nonzero().flatten()
    at_peak = at_peak[rows]
    first = at_peak & (at_peak.cumsum(-1, dtype=torch.int32) <= k)
    out[rows] = first.nonzero()[:, 1].view(-1, k)
    rows = (~flat).nonzero().flatten()
    if rows.numel():
        out[rows] = _whole_top(summed[rows], k)
    return out


def _whole_top(summed: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk over whole rows, ties across the k-th score in token order."""
    values, indices = summed.topk(k, dim=-1)
    kth = values[:, -1:]
    at = torch.eq(summed, kth).view(torch.uint8).sum(-1, dtype=torch.int32)
    tied = at > (values == kth).sum(-1)
    tied &= torch.isfinite(kth[:, 0])  # -inf ties are masked tokens, never attended
    rows = tied.nonzero().flatten()
    if rows.numel():
        indices[rows] = _earliest(summed[rows], kth[rows], k)
    return indices


def _earliest(summed: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the tokens scoring above the k-th score, then the earliest
    of those at it, each in token order."""
    above, at = summed > kth, summed == kth
    wanted = k - above.sum(-1, keepdim=True)
    chosen = (above | (at & (at.cumsum(-1) <= wanted))).nonzero()[:, 1].view(-1, k)
    order = at.gather(1, chosen).to(torch.uint8).sort(dim=-1, stable=True).indices
    return chosen.gather(1, order)
