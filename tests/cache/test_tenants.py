"""Tenants apart on a real cache server process: a client holding tenant B's
scoped token tries every call a client can make against tenant A's pages."""

import contextlib
import dataclasses
import hashlib
import io

import pytest

from kvrelay import rpc
from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.layout import ParallelConfig, rank_rectangle
from kvrelay.rpc import AuthError, Channel, Unavailable, scoped_token, token_scope
from kvrelay.rpc.agent_ops import AgentWelcome
from kvrelay.rpc.cache_ops import (
    CacheStats,
    CacheStatsReply,
    CacheWelcome,
    Commit,
    CommitReply,
    Flush,
    FlushReply,
    HandleReply,
    Lookup,
    LookupReply,
    PublishHandle,
    ReleaseLease,
    ReleaseReply,
    Reserve,
    ReserveReply,
)
from kvrelay.transfer import BlockHandle, TransferError, create_agent
from tests.cache.server_process import PAGE, TOKEN
from tests.cache.specs import SPEC

SPEC_A = dataclasses.replace(SPEC, salt="tenant a")
SPEC_B = dataclasses.replace(SPEC, salt="tenant b")
NS_A, NS_B = SPEC_A.namespace(), SPEC_B.namespace()
TOKEN_A, TOKEN_B = scoped_token(TOKEN, NS_A), scoped_token(TOKEN, NS_B)
PAGES = 6
KEYS = SPEC_A.page_keys(list(range(SPEC.page_size * PAGES)))
RECT = rank_rectangle(SPEC, ParallelConfig(tp=1))


def content(tenant: bytes, i: int) -> bytes:
    return hashlib.shake_128(tenant + i.to_bytes(4, "little")).digest(PAGE)


class Tenant:
    """A rank of one tenant: its own agent and client, both on its scoped token."""

    def __init__(self, spec, token):
        self.spec, self.token = spec, token

    async def start(self, address):
        self.agent = await create_agent("tcp", token=self.token)
        self.client = CacheClient(
            self.agent, self.spec, RECT, CacheClientConfig((address,), self.token, timeout_s=5)
        )
        self.local = self.agent.allocate_arena(PAGES * PAGE)
        return self

    async def write(self, keys, tenant: bytes) -> int:
        for i in range(len(keys)):
            self.local.buffer(i * PAGE, PAGE)[:] = content(tenant, i)
        return await self.client.write(keys, self.local, [i * PAGE for i in range(len(keys))])

    async def read(self, keys) -> tuple[int, bytes]:
        hit = await self.client.lookup(keys, self.local, [i * PAGE for i in range(len(keys))])
        return hit, bytes(self.local.buffer(0, hit * PAGE))

    async def close(self):
        await self.client.close()
        await self.agent.close()


def expected(tenant: bytes, count: int) -> bytes:
    return b"".join(content(tenant, i) for i in range(count))


def test_scoped_tokens():
    assert token_scope(TOKEN, TOKEN).every_namespace
    scope = token_scope(TOKEN_A, TOKEN)
    assert scope.namespace == NS_A and scope.allows(NS_A) and not scope.allows(NS_B)
    assert not scope.allows(None)
    assert token_scope(TOKEN_A, TOKEN, scoped=False) is None
    assert token_scope(TOKEN_A, "another cluster") is None
    forged = TOKEN_A.replace(NS_A.hex(), NS_B.hex())  # A's mac on B's namespace
    assert token_scope(forged, TOKEN) is None
    assert token_scope("kvrelay-ns:zz:00", TOKEN) is None
    with pytest.raises(ValueError):
        scoped_token(TOKEN, b"short")


@pytest.mark.asyncio
async def test_a_tenant_cannot_touch_another_tenants_pages(servers):
    server = servers()
    a = await Tenant(SPEC_A, TOKEN_A).start(server.address)
    b = await Tenant(SPEC_B, TOKEN_B).start(server.address)
    try:
        assert await a.write(KEYS, b"a") == PAGES
        assert await a.read(KEYS) == (PAGES, expected(b"a", PAGES))
        # B sends A's very keys: its lookups and probes find nothing ...
        assert await b.read(KEYS) == (0, b"")
        assert await b.client.count_prefix(KEYS) == 0
        # ... its writes land in its own pages, not on A's ...
        assert await b.write(KEYS, b"b") == PAGES
        assert await b.read(KEYS) == (PAGES, expected(b"b", PAGES))
        assert await a.read(KEYS) == (PAGES, expected(b"a", PAGES))
        # ... and its flushes, stats and admin calls are refused or touch only B.
        assert await b.client.server_stats() == {server.address: None}
        assert await b.client.admin_flush(None) == {server.address: None}
        assert await b.client.admin_flush(NS_A) == {server.address: None}
        assert await a.read(KEYS) == (PAGES, expected(b"a", PAGES))
        await raw_calls_refused(server)
        await leaked_handle_refused(server, a, b)
        # The cluster token (an operator) flushes one tenant and leaves the other.
        admin = Channel(server.address, TOKEN, CacheWelcome, 5)
        assert (await admin.call(Flush(NS_B), FlushReply)).dropped == PAGES
        assert await b.read(KEYS) == (0, b"")
        assert await a.read(KEYS) == (PAGES, expected(b"a", PAGES))
        admin.drop()
    finally:
        await a.close()
        await b.close()


async def raw_calls_refused(server):
    """Every request B's token can send that names A's namespace or leases."""
    a = Channel(server.address, TOKEN_A, CacheWelcome, 5)
    b = Channel(server.address, TOKEN_B, CacheWelcome, 5)
    looked = await a.call(Lookup(KEYS, 30, NS_A), LookupReply)
    assert looked.hits == PAGES
    run = [(0, PAGE)]
    refused = [
        (Lookup(KEYS, 30, NS_A), LookupReply),
        (Lookup(KEYS, 30, None), LookupReply),
        (Reserve(KEYS, 30, NS_A), ReserveReply),
        (Commit(KEYS, run, NS_A), CommitReply),
        (Commit(KEYS, run, None), CommitReply),
        (PublishHandle(looked.lease, 1, run, NS_A), HandleReply),
        (PublishHandle(looked.lease, 1, run, NS_B), HandleReply),
        (CacheStats(), CacheStatsReply),
        (Flush(NS_A), FlushReply),
        (Flush(None), FlushReply),
    ]
    for request, reply in refused:
        with pytest.raises(Unavailable, match="refused"):
            await b.call(request, reply)
    # A's lease is not B's to end: answered as unknown, and it still holds for A.
    assert not (await b.call(ReleaseLease(looked.lease), ReleaseReply)).released
    handle = await a.call(PublishHandle(looked.lease, PAGES, run, NS_A), HandleReply)
    assert BlockHandle.from_bytes(handle.handle).namespace == NS_A
    assert (await a.call(ReleaseLease(looked.lease), ReleaseReply)).released
    a.drop()
    b.drop()


async def leaked_handle_refused(server, a, b):
    """A handle of A's pages that reached B moves nothing for B's agent, whose
    welcome from the server's agent carries no rkey and no memory to map."""
    channel = Channel(server.address, TOKEN_A, CacheWelcome, 5)
    welcome = await channel.call(Lookup(KEYS[:1], 30, NS_A), LookupReply)
    reply = await channel.call(PublishHandle(welcome.lease, 1, [(0, PAGE)], NS_A), HandleReply)
    handle = BlockHandle.from_bytes(reply.handle)
    with pytest.raises(TransferError):
        await b.agent.read(handle, b.local, [0], namespace=NS_A, timeout=5)
    await a.agent.read(handle, a.local, [0], namespace=NS_A, timeout=5)
    assert bytes(a.local.buffer(0, PAGE)) == content(b"a", 0)
    server_agent = handle.agent
    conn, scoped = await rpc.connect(server_agent, TOKEN_B, AgentWelcome, 5)
    conn.close()
    conn, full = await rpc.connect(server_agent, TOKEN, AgentWelcome, 5)
    conn.close()
    assert all(not info.shm and not info.rkey for info in scoped.arenas)
    assert any(info.shm for info in full.arenas)
    channel.drop()


@pytest.mark.asyncio
async def test_bad_scoped_tokens_and_rkey_backends_refuse_tenants(servers):
    server = servers()
    forged = TOKEN_A.replace(NS_A.hex(), NS_B.hex())
    for token in (forged, scoped_token("another cluster", NS_A)):
        with pytest.raises(AuthError):
            await rpc.connect(server.address, token, CacheWelcome, 5)
    # A ucx agent hands out arena-wide rkeys: it admits the cluster token only.
    agent = await create_agent("ucx", token=TOKEN)
    try:
        with pytest.raises(AuthError):
            await rpc.connect(agent.address, TOKEN_A, AgentWelcome, 5)
        conn, _ = await rpc.connect(agent.address, TOKEN, AgentWelcome, 5)
        conn.close()
    finally:
        await agent.close()


def test_tenant_token_command():
    from kvrelay.cli import main

    with contextlib.redirect_stdout(io.StringIO()) as out:
        main(["tenant-token", "--token", TOKEN, "--namespace", NS_A.hex()])
    assert out.getvalue().strip() == TOKEN_A
    with pytest.raises(SystemExit, match="tenant-token"):
        main(["tenant-token", "--token", TOKEN, "--namespace", "abc"])
