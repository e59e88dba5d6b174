"""vLLM KV blocks <-> kvrelay unified pages.

A vLLM block holds `block_size` tokens of one layer. Every attention backend
views a layer's cache as `[num_blocks, num_kv_heads, block_size, content]`
(vLLM's logical [B, H, N, C]) over one allocation, with the physical order of
those axes the backend's layout: the CPU backend's is that order itself, the
GPU backends' HND is too and their NHD swaps heads and tokens. The content
of a (block, head, token) is K then V: on GPU plainly, `[2 * head_dim]` per
token; on CPU in a tiling chosen by the attention kernel for the ISA and
dtype (K transposed to [head_dim][block] for the vector kernels, 16-row
tiles for AMX) over the head's whole block. A unified page of the same tokens
holds, per head and layer, K[token][dim] ++ V[token][dim]
(`kvrelay.layout`, DESIGN.md section 3).

The tiling is not re-derived from vLLM's source: `probe_permutation` asks the
engine's own cache-write op where each (K or V, token, dim) element lands, once
per (dtype, block size, head dim), with integer codes spread over several
passes so that each pass is exact in the cache dtype. The result is one index
vector per head region (the head's `[block_size, content]` in logical
order), `perm[j]` = the region position of unified element j, so a page's
head-layer block is `region[perm]` and loading is the scatter
`region[perm] = block`. Every ISA and GPU backend is covered the same way;
the physical axis order is the tensors' strides, which indexing follows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# write(key, value, cache, slot_mapping): the engine's cache-write op for one
# layer; key/value [tokens, heads, head_dim], cache [blocks, heads, block, 2*dim].
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

# Integers below this are exact in every cache dtype the CPU kernels take
# (bfloat16 holds 8 significant bits).
_DIGIT_BASE = 128


class BlockLayoutError(ValueError):
    """The engine's cache layout is not one kvrelay can map to unified pages."""


def probe_permutation(
    write: CacheWriter,
    num_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """perm (int64, 2 * block_size * head_dim, on CPU): unified element j sits at
    region[perm[j]]. The write runs on `device`, the engine's."""
    n = 2 * block_size * head_dim
    codes = torch.arange(n, dtype=torch.int64)
    found = torch.zeros(num_heads, n, dtype=torch.int64)
    place, digits = 1, 1
    while place * _DIGIT_BASE < n:
        place *= _DIGIT_BASE
        digits += 1
    place = 1
    for _ in range(digits):
        digit = ((codes // place) % _DIGIT_BASE).to(torch.float32)
        kv = digit.view(2, block_size, head_dim)
        key, value = (
            half.unsqueeze(1).expand(block_size, num_heads, head_dim).to(device, dtype).contiguous()
            for half in kv
        )
        cache = torch.zeros(1, num_heads, block_size, 2 * head_dim, dtype=dtype, device=device)
        write(key, value, cache, torch.arange(block_size, dtype=torch.int64, device=device))
        found += cache.view(num_heads, n).cpu().to(torch.float64).round().to(torch.int64) * place
        place *= _DIGIT_BASE
    if not torch.equal(found, found[:1].expand_as(found)):
        raise BlockLayoutError("the cache write lays out heads differently from one another")
    position_code = found[0]
    if not torch.equal(position_code.sort().values, codes):
        raise BlockLayoutError(
            "the cache write does not place every K and V element of a block exactly once"
        )
    perm = torch.empty(n, dtype=torch.int64)
    perm[position_code] = codes
    return perm


def block_axes_dense(cache: torch.Tensor) -> bool:
    """Whether each block's [heads, tokens, content] elements are one dense run
    (in any axis order), so a block's bytes move as one piece."""
    axes = sorted(zip(cache.stride()[1:], cache.shape[1:], strict=True))
    expected = 1
    for stride, size in axes:
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


class BlockPages:
    """Moves whole pages (one vLLM block = one page) between layer caches and page rows.

    `caches`: the rank's layer caches in layer order, each logically
    `[num_blocks, local_heads, block_size, 2 * head_dim]` of one dtype, one
    device and any physical axis order. Page rows are host memory; a row
    viewed in the dtype is `[num_kv_heads, num_layers, 2 * block_size *
    head_dim]`, and this rank owns heads `[head_start, head_start +
    local_heads)` of it. Caches on a GPU are converted there, and the
    converted pages cross to the host in one copy per call.
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        perm: torch.Tensor,
        num_kv_heads: int,
        head_start: int,
    ) -> None:
        first = caches[0]
        if any(
            c.shape != first.shape or c.dtype != first.dtype or c.device != first.device
            for c in caches
        ):
            raise BlockLayoutError("every layer cache must have one shape, dtype and device")
        self.caches = list(caches)
        self.num_blocks, self.local_heads, self.block_size, fused = first.shape
        self.region = self.block_size * fused
        if perm.numel() != self.region:
            raise BlockLayoutError(f"a permutation of {self.region} elements is needed")
        self.device = first.device
        self.on_host = self.device.type == "cpu"
        self.perm = perm.to(self.device)
        self.num_kv_heads = num_kv_heads
        self.heads = slice(head_start, head_start + self.local_heads)
        self.dtype = first.dtype
        self.itemsize = first.element_size()
        self.page_bytes = num_kv_heads * len(caches) * self.region * self.itemsize

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [n, page_bytes] rows as [n, heads, layers, region] of the cache dtype."""
        return rows.view(self.dtype).view(
            rows.shape[0], self.num_kv_heads, len(self.caches), self.region
        )

    def _blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise IndexError(f"block ids must lie in [0, {self.num_blocks})")
        return ids.to(self.device)

    def gather(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Page rows[i] <- this rank's heads of block block_ids[i], every layer."""
        ids = self._blocks(block_ids)
        pages = self._rows(rows[: len(ids)])[:, self.heads]
        staged = pages if self.on_host else torch.empty(pages.shape, dtype=self.dtype,
                                                        device=self.device)  # fmt: skip
        for layer, cache in enumerate(self.caches):
            # index_select lays the blocks out in logical order, whatever the cache's
            regions = cache.index_select(0, ids).reshape(len(ids), self.local_heads, self.region)
            staged[:, :, layer, :] = regions.index_select(2, self.perm)
        if not self.on_host:
            pages.copy_(staged)

    def scatter(self, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Block block_ids[i] <- this rank's heads of page rows[i], every layer."""
        ids = self._blocks(block_ids)
        pages = self._rows(rows[: len(ids)])[:, self.heads].to(self.device)
        logical = (len(ids), *self.caches[0].shape[1:])
        for layer, cache in enumerate(self.caches):
            block = torch.empty(len(ids), self.local_heads, self.region, dtype=self.dtype,
                                device=self.device)  # fmt: skip
            block[:, :, self.perm] = pages[:, :, layer, :]
            cache.index_copy_(0, ids, block.view(logical))
