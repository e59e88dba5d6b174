"""A rank's paged KV pool and its local prefix index.

The pool holds, for each of the rank's layers, K and V tensors of
[num_pages * page_size, local_heads, head_dim]: slot = page * page_size +
offset, the addressing `kvrelay.cuda_ext` ops use. The pool's page size is
the unified page size, so one pool page holds exactly one unified page of a
sequence and a full page is named by one key of the layout's chain.

Pages are reference counted. A full page is registered in the prefix index
under its chained key; when its last user releases it, it stays cached
(evictable) until an allocation needs the room. The order is the cache
tier's default, prefix-LRU (`kvrelay.cache.eviction`): a match needs every
page before it, so a cached page whose parent page is gone is dead weight
and goes first; then the least recently released page with no cached page
after it in its chain (a page's parent is the page before it in the list a
request matched or released). LRU would take a chain's first page first
and leave the rest dead; this order takes its last, so every page LRU keeps
matchable it keeps too.
A request matching a cached prefix takes references on those pages and
computes only its suffix. Full pages are shared, never written.

A request's last, partial page is indexed too when the request ends, under
`partial_page_key(key of the page before it, its tokens)`: a local key,
never a cache-tier key (DESIGN.md keys full pages only). A later request
that continues those exact tokens copies them into a private page of its own
(`copy_tokens`), so a decode worker that received a prompt's KV, partial page
included, computes nothing of the prompt.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import torch

from kvrelay.cache.eviction import make_policy
from kvrelay.layout import tokens_as_uint32
from kvrelay.model.errors import PoolExhausted


def partial_page_key(parent: bytes, tokens) -> bytes:
    """Local index key of a partial page holding `tokens` after page key `parent`
    (the namespace for a sequence's first page). Domain-separated from the
    layout's chain, so it can never equal a full page's key."""
    data = tokens_as_uint32(list(tokens)).tobytes()
    return hashlib.sha256(b"kvrelay-partial-page" + parent + data).digest()


class PagePool:
    """Page bookkeeping shared by every pool kind: reference counts, the free
    list, the local prefix index and the eviction order. A subclass owns the
    storage (`copy_tokens`) and sets `device` and `dtype`."""

    def __init__(self, *, num_pages: int, page_size: int, num_layers: int) -> None:
        if min(num_pages, page_size, num_layers) <= 0:
            raise ValueError("pool dimensions must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._key_of_page: dict[int, bytes] = {}
        self._page_of_key: dict[bytes, int] = {}
        # Cached pages nobody uses; their order is `_order`'s, but for
        # `_orphans`, which go first (see the module doc).
        self._evictable: dict[int, None] = {}
        self._order = make_policy("prefix-lru")
        self._orphans: OrderedDict[int, None] = OrderedDict()
        self._orphaned: set[int] = set()  # in use, parent gone: an orphan once released
        self._parent: dict[int, int] = {}  # cached page -> the cached page before it
        self._children: dict[int, set[int]] = {}

    # -- capacity ---------------------------------------------------------
    @property
    def free_pages(self) -> int:
        """Pages an allocation can take now (free plus evictable cached pages)."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_pages(self) -> int:
        return len(self._page_of_key)

    def allocate(self, count: int) -> list[int]:
        """`count` private pages with one reference each; PoolExhausted (and
        nothing taken) when the pool cannot supply them."""
        if count > self.free_pages:
            raise PoolExhausted(count, self.free_pages)
        pages = []
        for _ in range(count):
            page = self._free.popleft() if self._free else self._evict()
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference on each page; unused keyed pages stay cached."""
        before = None  # the page before in the list: its chain parent
        for page in pages:
            if self.ref_counts[page] <= 0:
                raise RuntimeError(f"page {page} released more often than taken")
            self.ref_counts[page] -= 1
            keyed = page in self._key_of_page
            if self.ref_counts[page] == 0:
                if keyed:
                    self._cache(page, before)
                else:
                    self._free.append(page)
            before = page if keyed else None

    # -- prefix index -----------------------------------------------------
    def match_prefix(self, keys: list[bytes]) -> list[int]:
        """Pages of the longest cached run of `keys` from the start, each with a
        new reference taken for the caller."""
        pages = []
        for key in keys:
            page = self._page_of_key.get(key)
            if page is None:
                break
            pages.append(page)
        self.acquire(pages)
        return pages

    def acquire(self, pages: list[int]) -> None:
        for page in pages:
            if self.ref_counts[page] == 0 and page in self._evictable:
                del self._evictable[page]
                if page in self._orphans:
                    del self._orphans[page]
                    self._orphaned.add(page)
                else:
                    self._order.hold(page)
            self.ref_counts[page] += 1

    def register(self, page: int, key: bytes) -> bool:
        """Index full page `page` under `key`. False if the key is already
        cached (another request computed the same page): the page stays private."""
        if key in self._page_of_key or page in self._key_of_page:
            return False
        self._page_of_key[key] = page
        self._key_of_page[page] = key
        return True

    def key_of(self, page: int) -> bytes | None:
        return self._key_of_page.get(page)

    def clear_cache(self) -> None:
        """Forget every cached page no request is using."""
        while self._evictable:
            page, _ = self._evictable.popitem()
            self._order.forget(page)
            self._orphans.pop(page, None)
            self._uncache(page)
            self._free.append(page)

    # -- eviction order ---------------------------------------------------
    def _cache(self, page: int, parent: int | None) -> None:
        """Keyed `page`'s last user released it; `parent`: the page before it
        in the released list, if keyed."""
        self._evictable[page] = None
        if page in self._orphaned:
            self._orphaned.discard(page)
            self._orphans[page] = None
        elif page in self._order:
            self._order.make_evictable(page)
        else:
            up = parent if parent is not None and parent in self._order else None
            self._order.admit(page, up, True)
            if up is not None:
                self._parent[page] = up
                self._children.setdefault(up, set()).add(page)

    def _evict(self) -> int:
        """Take the next cached page out of the cache (one is evictable)."""
        if self._orphans:
            page, _ = self._orphans.popitem(last=False)
        else:
            page = self._order.victim()
            if page is None:  # every leaf is in use: one of their ancestors goes
                page = self._order.victim_inner()
        del self._evictable[page]
        self._uncache(page)
        return page

    def _uncache(self, page: int) -> None:
        """`page` left the cache (out of `_order` already): unkey it; the cached
        pages after it in their chains are dead weight now."""
        del self._page_of_key[self._key_of_page.pop(page)]
        up = self._parent.pop(page, None)
        if up is not None:
            self._children[up].discard(page)
        self._orphaned.discard(page)
        for child in self._children.pop(page, ()):
            del self._parent[child]
            if child in self._evictable:
                if child not in self._orphans:
                    self._order.forget(child)
                    self._orphans[child] = None
            else:
                self._order.forget(child)
                self._orphaned.add(child)

    # -- addressing -------------------------------------------------------
    def slots(self, pages: list[int], num_tokens: int, start: int = 0) -> torch.Tensor:
        """int64 slots of tokens [start, num_tokens) of a sequence on `pages`."""
        table = torch.as_tensor(pages, dtype=torch.int64)
        positions = torch.arange(start, num_tokens, dtype=torch.int64)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size


class PagedKVPool(PagePool):
    """Multi-head attention storage: per layer, K and V of [slots, local
    heads, head_dim]."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(num_pages=num_pages, page_size=page_size, num_layers=num_layers)
        if min(num_heads, head_dim) <= 0:
            raise ValueError("pool dimensions must be positive")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # One allocation; per-layer K and V are views with identical strides,
        # as the page copy ops require.
        slots = num_pages * page_size
        self.storage = torch.zeros(
            num_layers, 2, slots, num_heads, head_dim, dtype=dtype, device=device
        )
        self.device = self.storage.device
        self.k_layers = [self.storage[layer, 0] for layer in range(num_layers)]
        self.v_layers = [self.storage[layer, 1] for layer in range(num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's KV storage."""
        return self.storage.numel() * self.storage.element_size()

    def copy_tokens(self, source: int, destination: int, count: int) -> None:
        """K and V of the first `count` tokens of page `source` into page
        `destination`, every layer and head (a private copy of a shared page)."""
        ps = self.page_size
        src = slice(source * ps, source * ps + count)
        dst = slice(destination * ps, destination * ps + count)
        self.storage[:, :, dst] = self.storage[:, :, src]
