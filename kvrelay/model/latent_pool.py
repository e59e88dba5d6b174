"""A rank's paged KV pool for multi-head latent attention (MLA) with the
DeepSeek sparse attention (DSA) indexer: GLM-5, DeepSeek-V3.2, DeepSeek-V3.

Per token and layer the pool holds the latent row, the normed compressed KV
followed by the post-RoPE shared key (exactly what the model's own cache
holds, and the same on every TP rank), and, for each layer whose indexer runs,
that indexer's key. Layers that reuse an earlier layer's top-k have no
indexer key. Bookkeeping (references, prefix index, eviction) is
`PagePool`'s; only the storage differs from the multi-head pool.
"""

from __future__ import annotations

import torch

from kvrelay.model.pool import PagePool


class LatentKVPool(PagePool):
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        num_layers: int,
        latent_dim: int,
        index_dim: int = 0,
        index_local_layers: tuple[int, ...] = (),
        dtype: torch.dtype,
        index_dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(num_pages=num_pages, page_size=page_size, num_layers=num_layers)
        if latent_dim <= 0 or index_dim < 0:
            raise ValueError("pool dimensions must be positive")
        indexed = sorted(set(index_local_layers))
        if indexed and (index_dim == 0 or indexed[0] < 0 or indexed[-1] >= num_layers):
            raise ValueError(
                f"indexer layers {indexed} need index_dim > 0 and lie in [0, {num_layers})"
            )
        self.latent_dim = latent_dim
        self.index_dim = index_dim
        self.dtype = dtype
        self.index_dtype = dtype if index_dtype is None else index_dtype
        slots = num_pages * page_size
        # One allocation for the latents (a layer's rows are one view), one for
        # the indexer keys of the layers that have them.
        self.latent_storage = torch.zeros(num_layers, slots, latent_dim, dtype=dtype, device=device)
        self.device = self.latent_storage.device
        self.latent_layers = list(self.latent_storage.unbind(0))
        self.index_storage = torch.zeros(
            len(indexed), slots, max(index_dim, 1), dtype=self.index_dtype, device=self.device
        )[..., :index_dim]
        self.index_keys: list[torch.Tensor | None] = [None] * num_layers
        for position, layer in enumerate(indexed):
            self.index_keys[layer] = self.index_storage[position]
        self.index_local_layers = tuple(indexed)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's latent and indexer-key storage."""
        return sum(t.numel() * t.element_size() for t in (self.latent_storage, self.index_storage))

    def copy_tokens(self, source: int, destination: int, count: int) -> None:
        """Latents and indexer keys of the first `count` tokens of page `source`
        into page `destination`, every layer (a private copy of a shared page)."""
        ps = self.page_size
        src = slice(source * ps, source * ps + count)
        dst = slice(destination * ps, destination * ps + count)
        self.latent_storage[:, dst] = self.latent_storage[:, src]
        if self.index_local_layers:
            self.index_storage[:, dst] = self.index_storage[:, src]
