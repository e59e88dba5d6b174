"""What a cache server tells clients about its namespaces: the identity
fields each was made from, other namespaces of the same model and the fields
they differ in (a log line), page sizes it refuses (a log line), and
`kvrelay namespaces`' listing with page counts."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.cache.identities import NamespaceBook, list_namespaces, namespace_of
from kvrelay.cache.server import CacheServer, CacheServerConfig
from kvrelay.layout import Rectangle
from kvrelay.transfer import create_agent
from tests.cache.specs import SPEC

TOKEN = "t"
SGLANG = dataclasses.replace(SPEC, key_scheme="sglang")  # an SGLang-side spec


async def _client(agent, server, spec):
    rect = Rectangle(0, spec.num_kv_heads, 0, spec.num_layers)
    return CacheClient(agent, spec, rect, CacheClientConfig(servers=(server.address,), token=TOKEN))


@pytest.mark.asyncio
async def test_a_near_namespace_and_a_refused_page_size_are_reported(caplog):
    server = await CacheServer(
        CacheServerConfig(token=TOKEN, page_bytes=SPEC.page_bytes, arena_bytes=8 * SPEC.page_bytes)
    ).start()
    agent = await create_agent("tcp", token=TOKEN)
    arena = agent.allocate_arena(2 * SPEC.page_bytes)
    arena.tensor.copy_(torch.arange(arena.tensor.numel()).to(torch.uint8))
    clients = []
    try:
        writer = await _client(agent, server, SGLANG)
        clients.append(writer)
        keys = SGLANG.page_keys(list(range(2 * SPEC.page_size)))
        assert await writer.write(keys, arena, [0, SPEC.page_bytes]) == 2
        assert "shares no pages" not in caplog.text

        # The same model keyed by kvrelay's scheme: a miss, and the log says why.
        caplog.set_level(logging.WARNING, logger="kvrelay.cache.client")
        reader = await _client(agent, server, SPEC)
        clients.append(reader)
        assert await reader.count_prefix(SPEC.page_keys(list(range(2 * SPEC.page_size)))) == 0
        near = [r.getMessage() for r in caplog.records if "shares no pages" in r.getMessage()]
        assert len(near) == 1 and "(2 pages): they differ in key_scheme" in near[0]

        # Another page size: the server refuses the connection, and the log says so.
        wide = dataclasses.replace(SPEC, page_size=2 * SPEC.page_size)
        other = await _client(agent, server, wide)
        clients.append(other)
        assert await other.count_prefix(wide.page_keys(list(range(2 * wide.page_size)))) == 0
        assert any("holds pages of 2048 bytes, not 4096" in r.getMessage() for r in caplog.records)

        listed = (await list_namespaces([server.address], TOKEN))[server.address]
        pages = {entry["namespace"]: entry["pages"] for entry in listed}
        assert pages == {SGLANG.namespace().hex(): 2, SPEC.namespace().hex(): 0}
        fields = {e["namespace"]: e["identity"] for e in listed}
        assert fields[SGLANG.namespace().hex()]["key_scheme"] == "sglang"
        assert fields[SPEC.namespace().hex()]["page_size"] == SPEC.page_size
    finally:
        for client in clients:
            await client.close()
        await agent.close()
        await server.close()


def test_identities_must_hash_to_their_namespace():
    book = NamespaceBook(limit=2)
    fields = SPEC.identity_fields()
    assert namespace_of(fields) == SPEC.namespace()
    assert not book.record(SGLANG.namespace(), fields)
    assert book.record(SPEC.namespace(), fields)
    for size in (8, 16):
        spec = dataclasses.replace(SPEC, page_size=size)
        book.record(spec.namespace(), spec.identity_fields())
    assert SPEC.namespace() not in book.identities  # the oldest went first
