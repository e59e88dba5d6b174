"""kvrelay as SGLang's HiCache storage backend, driven as SGLang drives it.

Real SGLang classes (StorageBackendFactory's dynamic backend, HiCacheStorageConfig,
MHATokenToKVPoolHost / MLATokenToKVPoolHost on CPU, SGLang's page hash) against
real cache server processes. Pages are written by the ranks of one TP/PP
shape and read by ranks of others, checked element for element against the
source pages.
"""

from __future__ import annotations

import pytest
import torch

from tests.adapters import sglang_env as env
from tests.adapters.pages import read_page, write_page

PAGE, HEADS, LAYERS, DIM, WIDTH = 4, 4, 4, 8, 16
PAGES = 5
DTYPE = torch.bfloat16
IDENTITY = {"model_id": "test/tiny-model", "num_layers": LAYERS, "num_kv_heads": HEADS}
MHA_PAGE_BYTES = HEADS * LAYERS * PAGE * 2 * DIM * 2
MLA_PAGE_BYTES = LAYERS * PAGE * WIDTH * 2


@pytest.fixture
def cache_servers(request):
    started = [env.CacheServerProcess(request.param) for _ in range(2)]
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def opened():
    """Backends a test opened, closed at its end whatever happens."""
    backends = []
    yield backends
    for backend in backends:
        backend.close()


def _tokens(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (PAGES * PAGE,), generator=g).tolist()


def _truth(mla: bool, seed: int) -> torch.Tensor:
    """Global KV of each page: [page, kv, layer, token, head, dim] (MLA: no kv, one head)."""
    g = torch.Generator().manual_seed(seed)
    shape = (PAGES, LAYERS, PAGE, 1, WIDTH) if mla else (PAGES, 2, LAYERS, PAGE, HEADS, DIM)
    return torch.randn(shape, generator=g).to(DTYPE)


def _share(truth, mla, heads, layers):
    if mla:
        return truth[:, layers[0] : layers[1]]
    return truth[:, :, layers[0] : layers[1], :, heads[0] : heads[1]]


def _rank(
    opened, servers, layout, *, mla, tp=1, tp_rank=0, pp=1, pp_rank=0, groups=None, extra=None
):
    """A backend of one SGLang rank and its host pool; returns (backend, pool, heads, layers)."""
    layers_per_stage = LAYERS // pp
    layers = (pp_rank * layers_per_stage, (pp_rank + 1) * layers_per_stage)
    if mla:
        pool = env.mla_pool(layout, layers=layers_per_stage, start_layer=layers[0],
                            page_size=PAGE, width=WIDTH, dtype=DTYPE)  # fmt: skip
        heads = (0, 1)
    else:
        per = max(HEADS // tp, 1)
        h0 = tp_rank * per if tp <= HEADS else tp_rank // (tp // HEADS)
        heads = (h0, h0 + per)
        pool = env.mha_pool(layout, heads=per, layers=layers_per_stage, start_layer=layers[0],
                            page_size=PAGE, head_dim=DIM, dtype=DTYPE,
                            groups=per if groups is None else groups)  # fmt: skip
    extra = env.dynamic_extra(servers, **IDENTITY) | (extra or {})
    config = env.storage_config(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, mla=mla,
                                layout=layout, extra=extra)  # fmt: skip
    backend = env.create_backend(config, pool)
    opened.append(backend)
    return backend, pool, heads, layers


def _host_indices(pool, n: int) -> torch.Tensor:
    indices = pool.alloc(n * PAGE)
    assert indices is not None
    return indices


def _write(rank, truth, keys, mla) -> list[bool]:
    backend, pool, heads, layers = rank
    indices = _host_indices(pool, len(keys))
    local = _share(truth, mla, heads, layers)
    for i in range(len(keys)):
        write_page(pool, int(indices[i * PAGE]), local[i])
    return backend.batch_set_v1(keys, indices)


def _pool_holds(pool, indices, expected, why) -> None:
    """Every page of the call, read out of the host pool, is `expected`'s."""
    for i in range(PAGES):
        got = read_page(pool, int(indices[i * PAGE])).view(torch.int16)
        assert torch.equal(got, expected[i].view(torch.int16)), (why, i)


def _read_and_check(rank, truth, keys, mla) -> None:
    backend, pool, heads, layers = rank
    assert backend.batch_exists(keys) == len(keys)
    indices = _host_indices(pool, len(keys))
    assert backend.batch_get_v1(keys, indices) == [True] * len(keys)
    expected = _share(truth, mla, heads, layers)
    for i in range(len(keys)):
        got = read_page(pool, int(indices[i * PAGE]))
        assert torch.equal(got.view(torch.int16), expected[i].view(torch.int16)), (pool.layout, i)


@pytest.mark.parametrize("cache_servers", [MHA_PAGE_BYTES], indirect=True)
def test_mha_tp2_pages_read_by_tp1_tp4_and_pp2(cache_servers, opened):
    truth, keys = _truth(False, 1), env.sglang_keys(_tokens(1), PAGE)
    writers = [
        _rank(opened, cache_servers, "layer_first", mla=False, tp=2, tp_rank=r) for r in range(2)
    ]
    assert _write(writers[0], truth, keys, False) == [True] * PAGES
    # One of two rectangles is in: no page is sealed, so none exists yet.
    assert writers[0][0].batch_exists(keys) == 0
    assert _write(writers[1], truth, keys[:3], False) == [True] * 3
    assert writers[1][0].batch_exists(keys) == 3
    assert _write(writers[1], truth, keys, False) == [True] * PAGES
    readers = [
        _rank(opened, cache_servers, "page_head", mla=False),  # TP=1, strided permute
        *(_rank(opened, cache_servers, "page_first", mla=False, tp=4, tp_rank=r) for r in range(4)),
        *(
            _rank(opened, cache_servers, "page_unified", mla=False, pp=2, pp_rank=s)
            for s in range(2)
        ),
        _rank(opened, cache_servers, "page_first_direct", mla=False, pp=2, pp_rank=1),
        _rank(opened, cache_servers, "page_unified", mla=False, groups=1),  # 4 heads in one group
    ]
    assert readers[5][1].layout == "page_unified" and readers[5][0].tier.mover.zero_copy
    assert not readers[0][0].tier.mover.zero_copy
    for rank in readers:
        _read_and_check(rank, truth, keys, False)
    stats = readers[0][0].get_stats()
    assert stats.kvrelay["hit_pages"] == PAGES and stats.prefetch_pgs == [PAGES]
    assert stats.kvrelay["bytes_read"] == PAGES * MHA_PAGE_BYTES
    # The staged reader's pages came with its lookup (batch_exists); the
    # zero-copy one's straight into its pool on the get.
    assert stats.kvrelay["read_ahead_pages"] == PAGES
    assert readers[5][0].get_stats().kvrelay["read_ahead_pages"] == 0


@pytest.mark.parametrize("cache_servers", [MHA_PAGE_BYTES], indirect=True)
@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_calls_of_several_chunks_stop_at_a_miss_and_are_exact(cache_servers, opened, layout):
    truth, keys = _truth(False, 5), env.sglang_keys(_tokens(5), PAGE)
    chunked = {"staging_pages": 2}  # a call moves in chunks of 2 pages: 2 + 2 + 1
    writer = _rank(opened, cache_servers, layout, mla=False, extra=chunked)
    # Every page but the second chunk's second (page 3) is in.
    assert _write(writer, truth, keys[:3], False) == [True] * 3
    assert _write(writer, truth[4:], keys[4:], False) == [True]
    reader = _rank(opened, cache_servers, layout, mla=False, extra=chunked)
    backend, pool = reader[0], reader[1]
    pool.kv_buffer.fill_(7)
    indices = _host_indices(pool, PAGES)
    # No lookup first (no read-ahead): the get reads chunk by chunk.
    assert backend.batch_get_v1(keys, indices) == [True] * 3 + [False] * 2
    expected = _share(truth, False, reader[2], reader[3])
    for i in range(PAGES):
        got = read_page(pool, int(indices[i * PAGE])).view(torch.int16)
        want = expected[i] if i < 3 else torch.full_like(expected[i], 7)
        assert torch.equal(got, want.view(torch.int16)), (layout, i)
    client = backend.tier.clients[0][0]
    assert client.stats.lookups == 2  # the chunk after the miss was never asked for
    stats = backend.get_stats().kvrelay
    assert stats["hit_pages"] == 3 and stats["bytes_read"] == 3 * MHA_PAGE_BYTES
    assert stats["read_ahead_pages"] == 0 and stats["errors"] == 0
    # page_first: the compiled ops move pages between the pool and the
    # same-host servers' slots; page_head: through the staging rows.
    direct = layout == "page_first"
    assert stats["direct_pages"] == (3 if direct else 0)
    assert writer[0].get_stats().kvrelay["direct_pages"] == (4 if direct else 0)
    assert stats["caller_calls"] == 0  # a first call maps the servers' arenas on the loop
    assert _write(writer, truth[3:], keys[3:], False) == [True] * 2
    indices = _host_indices(pool, PAGES)
    assert backend.batch_get_v1(keys, indices) == [True] * PAGES
    _pool_holds(pool, indices, expected, layout)
    # Every server holding these pages is mapped now: page_first's next calls
    # run on the calling thread (`DirectLane`), page_head's never.
    before, wrote = backend.get_stats().kvrelay, writer[0].get_stats().kvrelay
    pool.kv_buffer.fill_(7)
    assert backend.batch_get_v1(keys, indices) == [True] * PAGES
    _pool_holds(pool, indices, expected, layout)
    assert _write(writer, truth, keys, False) == [True] * PAGES  # all sealed: nothing moves
    stats = backend.get_stats().kvrelay
    assert stats["caller_calls"] == before["caller_calls"] + direct and stats["errors"] == 0
    assert stats["direct_pages"] == before["direct_pages"] + (PAGES if direct else 0)
    assert writer[0].get_stats().kvrelay["caller_calls"] == wrote["caller_calls"] + direct
    # The lanes' calls met the servers' slot boards: the next get asks no server.
    pool.kv_buffer.fill_(7)
    assert backend.batch_get_v1(keys, indices) == [True] * PAGES
    _pool_holds(pool, indices, expected, layout)
    after = backend.get_stats().kvrelay
    assert after["board_reads"] == stats["board_reads"] + direct
    assert after["caller_calls"] == stats["caller_calls"] + direct


@pytest.mark.parametrize("cache_servers", [MLA_PAGE_BYTES], indirect=True)
def test_mla_one_writer_all_ranks_read_any_shape(cache_servers, opened):
    truth, keys = _truth(True, 2), env.sglang_keys(_tokens(2), PAGE)
    writers = [
        _rank(opened, cache_servers, "page_first", mla=True, tp=2, tp_rank=r) for r in range(2)
    ]
    # TP rank 1 holds a replica: it reports success and writes nothing.
    assert _write(writers[1], truth, keys, True) == [True] * PAGES
    assert writers[1][0].batch_exists(keys) == 0
    assert _write(writers[0], truth, keys, True) == [True] * PAGES
    readers = [
        _rank(opened, cache_servers, "layer_first", mla=True),
        *(_rank(opened, cache_servers, "page_unified", mla=True, tp=4, tp_rank=r) for r in (0, 3)),
        *(
            _rank(opened, cache_servers, "page_first_direct", mla=True, pp=2, pp_rank=s)
            for s in range(2)
        ),
    ]
    # SGLang caches DeepSeek's RoPE part as interleaved pairs, unified pages as
    # evens then odds: MLA pages are staged through a reorder, not moved in place.
    assert readers[1][0].tier.mover.rope == 4 and not readers[3][0].tier.mover.zero_copy
    for rank in readers:
        _read_and_check(rank, truth, keys, True)


@pytest.mark.asyncio
@pytest.mark.parametrize("cache_servers", [MHA_PAGE_BYTES], indirect=True)
async def test_plain_interface_kvrelay_client_and_killed_server(cache_servers, opened):

    from kvrelay.adapters.sglang.identity import kvrelay_key, sglang_page_keys
    from kvrelay.cache.client import CacheClient, CacheClientConfig
    from kvrelay.layout import Rectangle
    from kvrelay.transfer import create_agent

    tokens = _tokens(3)
    truth, keys = _truth(False, 3), env.sglang_keys(tokens, PAGE)
    assert sglang_page_keys(tokens, PAGE) == keys  # kvrelay names SGLang's pages
    # Plain interface: flat pages in get_data_page order, page_first -> page_head.
    backend, pool, *_ = _rank(opened, cache_servers, "page_first", mla=False)
    indices = _host_indices(pool, PAGES)
    for i in range(PAGES):
        write_page(pool, int(indices[i * PAGE]), truth[i])
    flats = [pool.get_data_page(int(indices[i * PAGE])) for i in range(PAGES)]
    assert backend.batch_set(keys, flats) is True
    reader, rpool, *_ = _rank(opened, cache_servers, "page_head", mla=False)
    got = reader.batch_get(keys, [rpool.get_dummy_flat_data_page() for _ in keys])
    assert all(g is not None for g in got) and backend.exists(keys[0])
    rindices = _host_indices(rpool, PAGES)
    for i, flat in enumerate(got):
        rpool.set_from_flat_data_page(int(rindices[i * PAGE]), flat)
        assert torch.equal(read_page(rpool, int(rindices[i * PAGE])), truth[i])

    # kvrelay's own cache client (whole-page rectangle) reads SGLang's pages.
    spec = backend.spec
    unified = truth.permute(0, 4, 2, 1, 3, 5).contiguous().view(PAGES, -1).view(torch.uint8)

    async def own_read():
        agent = await create_agent("tcp", token=env.TOKEN)
        arena = agent.allocate_arena(PAGES * spec.page_bytes)
        client = CacheClient(agent, spec, Rectangle(0, HEADS, 0, LAYERS),
                             CacheClientConfig(servers=tuple(s.address for s in cache_servers),
                                               token=env.TOKEN))  # fmt: skip
        ns = spec.namespace()
        found = await client.lookup([kvrelay_key(ns, k) for k in keys], arena,
                                    [i * spec.page_bytes for i in range(PAGES)])  # fmt: skip
        data = arena.tensor[: PAGES * spec.page_bytes].view(PAGES, -1).clone()
        await client.close()
        await agent.close()
        return found, data

    found, data = await own_read()
    assert found == PAGES and torch.equal(data, unified)

    # A cache server killed while a call waits on it: misses, within the bound.
    # Pages sit where the ring puts them, and the servers' ports are random: the
    # server killed is the one holding the first page, so that the tier's prefix
    # provably ends there (killing a fixed one misses nothing when the ring puts
    # all five pages on the other, about one run in thirty).
    import threading

    ring = reader.tier.clients[0][0].ring
    first = ring.server_for(kvrelay_key(reader.namespace, keys[0]))
    victim = next(s for s in cache_servers if s.address == first)
    victim.pause()  # stopped for sure: it cannot answer the call below
    results = {}
    fresh = env.sglang_keys(_tokens(4), PAGE)
    call = threading.Thread(
        target=lambda: results.update(got=reader.batch_get_v1(keys, _host_indices(rpool, PAGES)))
    )
    call.start()
    victim.kill()  # and gone: its port refuses from here on
    call.join(30)
    assert not call.is_alive()
    assert results["got"] == [False] * PAGES  # the first page's server is gone: no prefix
    assert reader.batch_exists(keys) == 0
    assert backend.batch_set_v1(fresh, _host_indices(pool, PAGES)) in ([False] * PAGES,
                                                                        [True] * PAGES)  # fmt: skip
    stats = reader.get_stats().kvrelay
    assert stats["miss_pages"] > 0 and stats["errors"] + stats["timeouts"] > 0


def test_unknown_extra_config_key_is_refused():
    from kvrelay.adapters.sglang.config import AdapterConfig, AdapterConfigError

    extra = {"servers": ["127.0.0.1:1"], "token": "t", "interface_v1": 1}
    assert AdapterConfig.from_extra_config(extra).servers == ("127.0.0.1:1",)
    with pytest.raises(AdapterConfigError, match="unknown extra config keys"):
        AdapterConfig.from_extra_config({**extra, "servres": []})
    for bad in ({"timeout_s": 0}, {"backend": "loopback"}, {"servers": ["no-port"]}):
        with pytest.raises(AdapterConfigError, match=next(iter(bad))):
            AdapterConfig.from_extra_config({**extra, **bad})


@pytest.mark.parametrize("cache_servers", [MHA_PAGE_BYTES], indirect=True)
def test_pages_a_lookup_pulled_are_read_on_the_callers_thread(cache_servers, opened):
    truth, keys = _truth(False, 3), env.sglang_keys(_tokens(3), PAGE)
    writer = _rank(opened, cache_servers, "layer_first", mla=False)
    assert _write(writer, truth, keys, False) == [True] * PAGES
    reader = _rank(opened, cache_servers, "layer_first", mla=False)
    backend = reader[0]
    assert backend.batch_exists(keys) == PAGES

    def no_loop(coro, timeout):  # a get of read-ahead pages needs neither loop nor server
        coro.close()
        raise AssertionError("went to the loop")

    indices = _host_indices(reader[1], PAGES)
    loop_run, backend._loop.run = backend._loop.run, no_loop
    try:
        assert backend.batch_get_v1(keys, indices) == [True] * PAGES
    finally:
        backend._loop.run = loop_run
    expected = _share(truth, False, reader[2], reader[3])
    _pool_holds(reader[1], indices, expected, "read ahead")
    # A later lookup takes the rows over: the pages are read from the servers.
    ahead = backend.tier.ahead
    backend.batch_exists(env.sglang_keys(_tokens(4), PAGE) * (ahead.capacity // PAGES))
    assert ahead.prefix(backend._keys(keys)).shape[0] == 0
    indices = _host_indices(reader[1], PAGES)
    assert backend.batch_get_v1(keys, indices) == [True] * PAGES
    got = read_page(reader[1], int(indices[(PAGES - 1) * PAGE]))
    assert torch.equal(got.view(torch.int16), expected[PAGES - 1].view(torch.int16))
    stats = backend.get_stats().kvrelay
    assert stats["read_ahead_pages"] == PAGES and stats["hit_pages"] == 2 * PAGES


@pytest.mark.parametrize("cache_servers", [MHA_PAGE_BYTES], indirect=True)
def test_without_the_fast_path_token_layouts_go_through_staging_rows(cache_servers, opened):
    """Servers the agent may not map (another host; here the fast path turned
    off): the same pages, byte for byte, through the staging rows."""
    import dataclasses

    truth, keys = _truth(False, 7), env.sglang_keys(_tokens(7), PAGE)
    ranks = []
    for _ in range(2):
        rank = _rank(opened, cache_servers, "layer_first", mla=False)
        agent = rank[0].tier.agent
        agent.config = dataclasses.replace(agent.config, fast_path=False)
        ranks.append(rank)
    assert _write(ranks[0], truth, keys, False) == [True] * PAGES
    backend, pool = ranks[1][0], ranks[1][1]
    indices = _host_indices(pool, PAGES)
    assert backend.batch_get_v1(keys, indices) == [True] * PAGES  # no lookup first
    _pool_holds(pool, indices, truth, "staged")
    for rank in ranks:
        stats = rank[0].get_stats().kvrelay
        assert stats["direct_pages"] == 0 and stats["errors"] == 0
    assert backend.get_stats().kvrelay["hit_pages"] == PAGES


@pytest.mark.parametrize("cache_servers", [MHA_PAGE_BYTES], indirect=True)
def test_pp_stages_move_their_heads_straight_between_pool_and_slots(cache_servers, opened):
    """A PP stage's rectangle is a client per head: each copies its head's
    blocks straight into (and out of) the same-host servers' slots."""
    truth, keys = _truth(False, 9), env.sglang_keys(_tokens(9), PAGE)
    for stage in range(2):
        writer = _rank(opened, cache_servers, "page_first", mla=False, pp=2, pp_rank=stage)
        assert _write(writer, truth, keys, False) == [True] * PAGES
        assert writer[0].get_stats().kvrelay["direct_pages"] == PAGES
    for layout, pp in (("layer_first", 1), ("page_first", 2)):
        backend, pool, heads, layers = _rank(opened, cache_servers, layout, mla=False, pp=pp,
                                             pp_rank=pp - 1)  # fmt: skip
        indices = _host_indices(pool, PAGES)
        assert backend.batch_get_v1(keys, indices) == [True] * PAGES  # no lookup first
        expected = _share(truth, False, heads, layers)
        for i in range(PAGES):
            got = read_page(pool, int(indices[i * PAGE]))
            assert torch.equal(got.view(torch.int16), expected[i].view(torch.int16)), (layout, i)
        stats = backend.get_stats().kvrelay
        assert stats["direct_pages"] == PAGES and stats["errors"] == 0
