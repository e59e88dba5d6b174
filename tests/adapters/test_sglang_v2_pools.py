"""HiCache's v2 storage interface: SGLang's named host pools on kvrelay pages.

Real SGLang host pools on CPU (MLATokenToKVPoolHost with packed MTP layers,
DSAIndexerPoolHost built from the declaration SGLang's DSA device pool
makes, an MLA draft sidecar pool), registered and moved in the order SGLang's
hybrid cache controller uses: the anchor KV pool, then each pool by name,
`on_host_pools_registered`; sidecars first (`batch_set_v2`), then the KV
pages (`batch_set_v1`); `batch_exists_v2` with the pools' transfers, the KV
get (`batch_get_v1`), then the sidecars' (`batch_get_v2`). Every get's bytes
are checked against the source pool's.
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.adapters.sglang.harness import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    dsa_indexer_pool,
)
from kvrelay.adapters.sglang.identity import UnsupportedPool
from tests.adapters import sglang_env as env

PAGE, LAYERS, WIDTH, ROPE = 64, 3, 24, 8
PAGES = 4
TOKENS = 8 * PAGE  # device pool size; host pools hold twice that
DTYPE = torch.bfloat16
SKIP = (1,)  # layer 1 reuses layer 0's top-k: no indexer keys
IDENTITY = {"model_id": "test/tiny-dsa", "num_layers": LAYERS, "index_topk": 32}


def _page_bytes(index: bool = True) -> int:
    latent = PAGE * WIDTH * 2
    return LAYERS * latent + (LAYERS - len(SKIP)) * PAGE * (128 + 4) * index


@pytest.fixture
def servers(request):
    """Two cache servers for the target pages (with indexer keys unless the
    test's parameter says False)."""
    index = getattr(request, "param", True)
    started = [env.CacheServerProcess(_page_bytes(index)) for _ in range(2)]
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def opened():
    backends = []
    yield backends
    for backend in backends:
        backend.close()


def _tokens(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (PAGES * PAGE,), generator=g).tolist()


def _stage(pp: int, pp_rank: int) -> tuple[int, int]:
    per = -(-LAYERS // pp)
    return pp_rank * per, min(LAYERS, (pp_rank + 1) * per)


def _rank(opened, servers, layout, *, pp=1, pp_rank=0, tp=1, tp_rank=0, packed=1, index=True):
    """One SGLang rank's backend with its KV (and indexer) pool registered as
    the hybrid controller registers them."""
    l0, l1 = _stage(pp, pp_rank)
    last = pp_rank == pp - 1
    kv = env.mla_pool(layout, layers=l1 - l0, start_layer=l0, page_size=PAGE, width=WIDTH,
                      dtype=DTYPE, rope=ROPE, packed=packed if last else 0,
                      device_tokens=TOKENS)  # fmt: skip
    skip = tuple(i - l0 for i in SKIP if l0 <= i < l1)
    extra = env.dynamic_extra(servers, **IDENTITY, index_layers=[0, 2])
    config = env.storage_config(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, mla=True,
                                layout=layout, extra=extra)  # fmt: skip
    backend = env.create_backend(config, kv)
    opened.append(backend)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    ix = None
    if index:
        ix = dsa_indexer_pool(kv, skip=skip, packed=packed if last else 0, device_tokens=TOKENS)
        backend.register_mem_host_pool_v2(ix, PoolName.INDEXER)
    backend.on_host_pools_registered()
    return backend, kv, ix


def _fill(pool, indices, seed: int) -> None:
    """Random bytes in every host page of `indices` (all layers, packed ones too)."""
    g = torch.Generator().manual_seed(seed)
    for start in range(0, len(indices), PAGE):
        page = pool.get_data_page(int(indices[start]), flat=True)
        noise = torch.randint(0, 255, (page.numel() * page.element_size(),), generator=g)
        data = noise.to(torch.uint8).view(page.dtype)
        pool.set_from_flat_data_page(int(indices[start]), data)


def _layers(pool, index: int, layers) -> torch.Tensor:
    """Host layers `layers` of one host page, [layer, ...] (either pool kind)."""
    page = pool.get_data_page(index, flat=False)
    if hasattr(pool, "kv_cache_dim"):
        if pool.layout == "layer_first":
            page = page.reshape(pool.layer_num, PAGE, -1)
        elif pool.layout == "page_first":
            page = page.reshape(PAGE, pool.layer_num, -1).transpose(0, 1)
        else:
            page = page.reshape(pool.layer_num, PAGE, -1)
    else:  # indexer records: [layer, 1, stride] or [1, layer, 1, stride]
        page = page.reshape(pool.layer_num, -1)
    return page[list(layers)].clone()


def _write(backend, kv, ix, keys, seed=1):
    idx = kv.alloc(len(keys) * PAGE)
    _fill(kv, idx, seed)
    if ix is not None:
        _fill(ix, idx, seed + 1)
        done = backend.batch_set_v2([PoolTransfer(PoolName.INDEXER, host_indices=idx, keys=keys)])
        assert done[PoolName.INDEXER] == [True] * len(keys)
    assert backend.batch_set_v1(keys, idx) == [True] * len(keys)
    return idx


def _read(backend, kv, ix, keys, transfers=None):
    """As the controller prefetches: exists_v2, the KV get, then the sidecars'."""
    names = [PoolName.INDEXER] if ix is not None else []
    transfers = transfers or [PoolTransfer(n, keys=keys) for n in names]
    hit = backend.batch_exists_v2(keys, transfers)
    n = hit.kv_hit_pages
    idx = kv.alloc(len(keys) * PAGE)
    got = backend.batch_get_v1(keys[:n], idx[: n * PAGE])
    assert got == [True] * n
    if ix is not None and n:
        more = backend.batch_get_v2(
            [PoolTransfer(PoolName.INDEXER, host_indices=idx[: n * PAGE], keys=keys[:n])]
        )
        assert more[PoolName.INDEXER] == [True] * n
    return hit, idx


def _same(src, src_idx, dst, dst_idx, pages, src_layers, dst_layers) -> None:
    for p in range(pages):
        want = _layers(src, int(src_idx[p * PAGE]), src_layers)
        got = _layers(dst, int(dst_idx[p * PAGE]), dst_layers)
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8)), p


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_dsa_pages_with_packed_mtp_are_read_by_other_shapes(opened, servers, layout):
    keys = env.sglang_keys(_tokens(1), PAGE)
    writer, kv, ix = _rank(opened, servers, layout)
    assert writer.routes.spec.index_layers == (0, 2) and writer.routes.spec.index_dtype == "uint8"
    assert writer.routes.spec.page_bytes == _page_bytes() and writer.draft is not None
    src = _write(writer, kv, ix, keys)

    # The same shape in another host layout: every layer, packed MTP layer included.
    other = "layer_first" if layout != "layer_first" else "page_first_direct"
    reader, kv2, ix2 = _rank(opened, servers, other)
    hit, dst = _read(reader, kv2, ix2, keys)
    assert hit.kv_hit_pages == PAGES and hit.restorable_prefix_pages == list(range(1, PAGES + 1))
    _same(kv, src, kv2, dst, PAGES, range(LAYERS + 1), range(LAYERS + 1))
    _same(ix, src, ix2, dst, PAGES, range(3), range(3))

    # PP=2 (stage 0: layers 0-1, indexer on 0; stage 1: layer 2 and the MTP
    # layer) and TP=2 replicas (MLA: every rank reads the one latent).
    for pp_rank in range(2):
        l0, l1 = _stage(2, pp_rank)
        for tp_rank in range(2):
            r, kv3, ix3 = _rank(opened, servers, "page_first", pp=2, pp_rank=pp_rank, tp=2,
                                tp_rank=tp_rank)  # fmt: skip
            assert r.namespace == writer.namespace and r.rect.writer == (tp_rank == 0)
            hit, got = _read(r, kv3, ix3, keys)
            assert hit.kv_hit_pages == PAGES
            local = range(l1 - l0) if pp_rank == 0 else range(l1 - l0 + 1)
            _same(kv, src, kv3, got, PAGES, [l0 + i for i in local], local)
            src_ix = [0] if pp_rank == 0 else [1, 2]  # writer's host indexer layers
            _same(ix, src, ix3, got, PAGES, src_ix, range(len(src_ix)))


def test_a_missing_indexer_page_shortens_the_hit(opened, servers):
    keys = env.sglang_keys(_tokens(2), PAGE)
    writer, kv, ix = _rank(opened, servers, "page_first_direct", packed=0)
    idx = kv.alloc(PAGES * PAGE)
    _fill(kv, idx, 5)
    _fill(ix, idx, 6)
    # The indexer's keys of the first two pages only, then every KV page.
    writer.batch_set_v2([PoolTransfer(PoolName.INDEXER, host_indices=idx[: 2 * PAGE],
                                      keys=keys[:2])])  # fmt: skip
    assert writer.batch_set_v1(keys, idx) == [True] * PAGES
    reader, kv2, ix2 = _rank(opened, servers, "page_first_direct", packed=0)
    hit, dst = _read(reader, kv2, ix2, keys)
    assert hit.kv_hit_pages == 2 and hit.extra_pool_hit_pages[PoolName.INDEXER] == 2
    assert reader.batch_exists(keys) == 2  # v1's lookup agrees
    assert reader.batch_get_v1(keys, kv2.alloc(PAGES * PAGE)) == [True] * 2 + [False] * 2
    _same(ix, idx, ix2, dst, 2, range(2), range(2))
    with pytest.raises(UnsupportedPool, match="interface_v1"):
        reader.batch_get(keys[:1])  # flat pages of one pool cannot fill such a page
    # A pool without its indexer is another namespace (and page size).
    plain = _rank(opened, servers, "page_first_direct", packed=0, index=False)[0]
    assert plain.namespace != writer.namespace and plain.batch_exists(keys) == 0


@pytest.mark.parametrize("servers", [False], indirect=True)
def test_draft_sidecar_pool_hit_policies(opened, servers):
    keys = env.sglang_keys(_tokens(3), PAGE)

    def rank():
        backend, kv, _ = _rank(opened, servers, "page_first", packed=0, index=False)
        draft = env.mla_pool("page_first", layers=1, start_layer=0, page_size=PAGE,
                             width=WIDTH, dtype=DTYPE, rope=ROPE, device_tokens=TOKENS)  # fmt: skip
        backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)  # after the burst
        assert backend.draft is not None and backend.draft_namespace != backend.namespace
        return backend, kv, draft

    writer, kv, draft = rank()
    idx = kv.alloc(PAGES * PAGE)
    _fill(kv, idx, 7)
    _fill(draft, idx, 8)
    # Draft pages of the first three pages only.
    sidecar = PoolTransfer(PoolName.DRAFT, host_indices=idx[: 3 * PAGE], keys=keys[:3])
    assert writer.batch_set_v2([sidecar])[PoolName.DRAFT] == [True] * 3
    assert writer.batch_set_v1(keys, idx) == [True] * PAGES

    reader, kv2, draft2 = rank()
    every = PoolTransfer(PoolName.DRAFT, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    hit = reader.batch_exists_v2(keys, [every])
    assert hit.kv_hit_pages == 3 and hit.extra_pool_hit_pages[PoolName.KV] == PAGES
    # Trailing pages: the last two of a prefix must be in (lengths 1-3).
    tail = PoolTransfer(PoolName.DRAFT, keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert reader.batch_exists_v2(keys, [tail]).restorable_prefix_pages == [1, 2, 3]
    dst = kv2.alloc(PAGES * PAGE)
    assert reader.batch_get_v1(keys[:3], dst[: 3 * PAGE]) == [True] * 3
    got = reader.batch_get_v2(
        [PoolTransfer(PoolName.DRAFT, host_indices=dst[: 3 * PAGE], keys=keys[:3])]
    )
    assert got[PoolName.DRAFT] == [True] * 3
    _same(kv, idx, kv2, dst, 3, range(LAYERS), range(LAYERS))
    _same(draft, idx, draft2, dst, 3, [0], [0])


@pytest.mark.parametrize("servers", [False], indirect=True)
@pytest.mark.parametrize(
    "name",
    [PoolName.SWA, PoolName.MAMBA, PoolName.DEEPSEEK_V4_C4, PoolName.DRAFT_SWA,
     PoolName.AUXILIARY_SWA],
)  # fmt: skip
def test_pools_kvrelay_does_not_hold_are_refused(opened, servers, name):
    backend, kv, _ = _rank(opened, servers, "page_first", packed=0, index=False)
    with pytest.raises(UnsupportedPool, match=name.value):
        backend.register_mem_host_pool_v2(kv, name)


def test_dsa_pages_need_index_topk(opened, servers):
    kv = env.mla_pool("page_first", layers=LAYERS, start_layer=0, page_size=PAGE, width=WIDTH,
                      dtype=DTYPE, rope=ROPE, device_tokens=TOKENS)  # fmt: skip
    extra = env.dynamic_extra(servers, model_id="test/tiny-dsa")
    backend = env.create_backend(env.storage_config(mla=True, layout="page_first", extra=extra), kv)
    opened.append(backend)
    backend.register_mem_host_pool_v2(dsa_indexer_pool(kv, device_tokens=TOKENS), PoolName.INDEXER)
    with pytest.raises(UnsupportedPool, match="index_topk"):
        backend.on_host_pools_registered()


def _controller(backend, kv, ix):
    """SGLang's HybridCacheController with only what its storage calls read
    (no device pools, threads or process groups on CPU)."""
    import contextlib
    from queue import Queue
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    ctl = HybridCacheController.__new__(HybridCacheController)
    ctl.storage_backend, ctl.storage_backend_type = backend, "dynamic"
    ctl.page_size, ctl.storage_config = PAGE, backend.storage_config
    entries = {PoolName.KV: SimpleNamespace(host_pool=kv)}
    if ix is not None:
        entries[PoolName.INDEXER] = SimpleNamespace(host_pool=ix)
    ctl.mem_pool_host = SimpleNamespace(layout_lease=contextlib.nullcontext, entry_map=entries)
    ctl.storage_host_pool = kv
    ctl.page_set_func, ctl.page_get_func = ctl._page_set_zero_copy, ctl._page_get_zero_copy
    ctl.prefetch_sync_queue = Queue()
    return ctl


def test_the_controllers_own_backup_and_prefetch(opened, servers):
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        PrefetchOperation,
        StorageOperation,
    )

    tokens = _tokens(4)

    def sidecars():
        return [PoolTransfer(PoolName.INDEXER, indices_from_pool=PoolName.KV)]

    writer, kv, ix = _rank(opened, servers, "page_first_direct")
    src = kv.alloc(PAGES * PAGE)
    _fill(kv, src, 11)
    _fill(ix, src, 12)
    keys = env.sglang_keys(tokens, PAGE)
    backup = StorageOperation(src, tokens, hash_value=keys, pool_transfers=sidecars())
    _controller(writer, kv, ix)._page_backup(backup)
    assert backup.completed_tokens == PAGES * PAGE
    assert backup.pool_storage_result.extra_pool_hit_pages == {PoolName.INDEXER: PAGES}

    reader, kv2, ix2 = _rank(opened, servers, "layer_first")
    ctl = _controller(reader, kv2, ix2)
    fetch = PrefetchOperation(SimpleNamespace(rid="r1"), tokens, pool_transfers=sidecars())
    hashes, hit_tokens = ctl._storage_hit_query(fetch)
    assert hashes == keys and hit_tokens == PAGES * PAGE
    assert fetch.query_pool_hit_pages == {PoolName.KV: PAGES, PoolName.INDEXER: PAGES}
    fetch.hash_value, fetch.host_indices = hashes, kv2.alloc(PAGES * PAGE)
    ctl._page_transfer(fetch)
    acks = [ctl.prefetch_sync_queue.get_nowait() for _ in range(2)]
    assert acks[0].completed_tokens == PAGES * PAGE
    _same(kv, src, kv2, fetch.host_indices, PAGES, range(LAYERS + 1), range(LAYERS + 1))
    _same(ix, src, ix2, fetch.host_indices, PAGES, range(3), range(3))
