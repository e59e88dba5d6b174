import argparse
import json

import pytest

from kvrelay.bench import cache as cache_bench
from kvrelay.cache.l3.file import FileStore, FileStoreConfig
from kvrelay.cli import main
from kvrelay.layout.ring import HashRing
from kvrelay.transfer import create_agent


def write_trace(path, requests: int = 60) -> None:
    # Ten conversations, each request extending its conversation's prefix by
    # two blocks: requests of one conversation land on different workers.
    lines = []
    for r in range(requests):
        conv, turn = r % 10, r // 10
        ids = [conv * 1000 + i for i in range(2 + 2 * turn)]
        lines.append(json.dumps({"timestamp": r, "input_length": 512 * len(ids) - 100,
                                 "output_length": 4, "hash_ids": ids}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def test_bench_cache_replays_and_reports(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    out, png = tmp_path / "out.json", tmp_path / "hit.png"
    main(["bench", "cache", "--trace", str(trace), "--workers", "4", "--servers", "2",
          "--capacities", "8,400", "--json", str(out), "--plot", str(png),
          "--no-progress"])  # fmt: skip
    payload = json.loads(out.read_text())
    infinite = payload["infinite"]["block_hit_rate"]
    # Turn t reuses the 2t blocks of turn t-1: sum over turns of 2t / (2 + 2t).
    expected = sum(2 * t for t in range(6)) / sum(2 + 2 * t for t in range(6))
    assert abs(infinite - expected) < 1e-9
    small, large = payload["capacities"]
    # Capacity covering the working set: the shared tier is the optimum.
    assert large["shared"]["block_hit_rate"] >= 0.97 * infinite
    # Round robin over 4 workers sends conversation c's turn t to worker
    # (c + 2t) % 4: a local cache only has turn t-2's 2t-2 blocks.
    local = sum(2 * t - 2 for t in range(2, 6)) / sum(2 + 2 * t for t in range(6))
    assert abs(large["local"]["block_hit_rate"] - local) < 1e-9
    assert small["shared"]["block_hit_rate"] < large["shared"]["block_hit_rate"]
    assert large["shared"]["token_hit_rate"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "shared/inf" in capsys.readouterr().out


def test_bench_cache_with_l3_reaches_the_optimum_at_small_l2(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    out = tmp_path / "out.json"
    main(["bench", "cache", "--trace", str(trace), "--workers", "4", "--servers", "2",
          "--capacities", "24", "--json", str(out), "--no-progress"])  # fmt: skip
    payload = json.loads(out.read_text())
    infinite = payload["infinite"]["block_hit_rate"]
    (entry,) = payload["capacities"]
    l3 = entry["shared_l3"]
    # L2 alone holds 24 of the 70 pages; an L3 over the working set recovers the optimum.
    assert entry["shared"]["block_hit_rate"] < 0.5 * infinite
    assert l3["block_hit_rate"] >= 0.97 * infinite
    assert l3["l3_hit_pages"] > 0 and l3["l3_promotions"] >= l3["l3_hit_pages"]
    assert l3["l2_hit_pages"] + l3["l3_hit_pages"] == round(l3["block_hit_rate"] * 420)
    assert l3["l3_store_bytes_out"] == 256 * l3["l3_promotions"]
    assert l3["wrong_pages"] == 0 and l3["l3_checksum_failures"] == 0
    main(["bench", "cache", "--trace", str(trace), "--workers", "4", "--servers", "2",
          "--capacities", "8", "--json", str(out), "--no-progress", "--l3", "none"])  # fmt: skip
    assert "shared_l3" not in json.loads(out.read_text())["capacities"][0]


class ShiftedStore(FileStore):
    """Answers every L3 hit with the bytes of the page stored before it: a wrong page."""

    def get_many(self, keys, namespace=b""):
        pages = super().get_many(keys, namespace)
        return [None if p is None else p[1:] + p[:1] for p in pages]


class RottingStore(FileStore):
    """Flips a byte of every file it writes, as a failing disk would."""

    def put(self, key, page, namespace=b""):
        stored = super().put(key, page, namespace)
        path = self._path(key, namespace)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        return stored


async def replay_with(store_class, tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    requests = cache_bench.load_trace(trace)
    chain = cache_bench.KeyChain(512)
    key_lists = [chain.keys(r["hash_ids"]) for r in requests]
    args = argparse.Namespace(block_tokens=512, page_bytes=1 << 20)
    agent = await create_agent("loopback", token="t", fast_path=False)
    stores = [store_class(FileStoreConfig(tmp_path / f"l3-{i}", 1 << 20)) for i in range(2)]
    tiers = cache_bench._tiers(agent, 2, 4, 256, stores)
    ring = HashRing(["a", "b"])
    counts = cache_bench._replay_tiers(
        tiers, lambda _n, k: ring.servers.index(ring.server_for(k)), requests, key_lists,
        args, lambda: None,
    )  # fmt: skip
    await agent.close()
    return counts


@pytest.mark.asyncio
async def test_a_wrong_page_from_l3_is_detected(tmp_path):
    counts = await replay_with(ShiftedStore, tmp_path)
    assert counts.wrong_pages > 0 and counts.promotions > 0


@pytest.mark.asyncio
async def test_corrupt_l3_records_are_misses(tmp_path):
    counts = await replay_with(RottingStore, tmp_path)
    assert counts.checksum_failures > 0 and counts.l3_hit_pages == 0 and counts.wrong_pages == 0
