import argparse
import itertools
import json

import pytest

from kvrelay.bench import cache as cache_bench
from kvrelay.bench.cache_tiers import l3_stores, make_tiers
from kvrelay.bench.oracles import ORACLES
from kvrelay.cache.eviction import DEFAULT_POLICY
from kvrelay.cache.l3 import record
from kvrelay.cache.l3.file import FileStore, FileStoreConfig
from kvrelay.cli import main
from kvrelay.layout.ring import HashRing
from kvrelay.transfer import create_agent


def write_trace(path, requests: int = 60, short_by: int = 0) -> None:
    # Ten conversations, each request extending its conversation's prefix by
    # two blocks: requests of one conversation land on different workers.
    # `short_by` tokens fewer than the blocks: the last block is partial.
    lines = []
    for r in range(requests):
        conv, turn = r % 10, r // 10
        ids = [conv * 1000 + i for i in range(2 + 2 * turn)]
        lines.append(json.dumps({"timestamp": r, "input_length": 512 * len(ids) - short_by,
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


def test_a_partial_last_block_is_no_page(tmp_path):
    # Each request's last block is 412 tokens: turn t has 1 + 2t full pages
    # and finds the 2t - 1 of turn t-1 (its partial block was never cached).
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, short_by=100)
    out = tmp_path / "out.json"
    main(["bench", "cache", "--trace", str(trace), "--workers", "4", "--servers", "2",
          "--capacities", "400", "--l3", "none", "--policies", "lru", "--cost-rounds", "1",
          "--json", str(out), "--no-progress"])  # fmt: skip
    payload = json.loads(out.read_text())
    assert payload["unique_pages"] == 10 * 11
    hits = sum(2 * t - 1 for t in range(1, 6))
    assert payload["infinite"]["block_hit_rate"] == pytest.approx(hits / sum(range(1, 12, 2)))
    tokens = sum(512 * (2 + 2 * t) - 100 for t in range(6))
    assert payload["infinite"]["token_hit_rate"] == pytest.approx(512 * hits / tokens)
    (entry,) = payload["capacities"]
    assert entry["policies"]["lru"]["block_hit_rate"] == payload["infinite"]["block_hit_rate"]


@pytest.mark.parametrize(
    ("tokens", "ids", "pages"),
    [(1024, 2, 2), (1000, 2, 1), (1025, 3, 2), (300, 1, 0), (0, 0, 0)],
)
def test_full_blocks_are_the_pages(tokens, ids, pages):
    request = {"input_length": tokens, "hash_ids": list(range(ids))}
    assert cache_bench.full_block_ids(request, 512) == list(range(pages))


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        ({"input_length": 1024, "hash_ids": [1]}, "1 hash ids for 1024 input tokens"),
        ({"input_length": 1000, "hash_ids": [1, 2, 3]}, "3 hash ids for 1000 input tokens"),
        ({"hash_ids": [1]}, "no 'input_length' field"),
    ],
)
def test_ids_that_are_not_the_prompts_blocks_are_refused(tmp_path, request_, reason):
    trace = tmp_path / "trace.jsonl"
    good = {"input_length": 512, "hash_ids": [7]}
    trace.write_text(json.dumps(good) + "\n" + json.dumps(request_) + "\n")
    with pytest.raises(SystemExit, match=f"request 2: {reason}"):
        main(["bench", "cache", "--trace", str(trace), "--l3", "none", "--no-progress"])


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


def test_prompts_longer_than_l2_are_kept_whole_by_the_l3(tmp_path):
    """Two conversations of 40-block prompts over a tier whose L2 holds 8
    pages: each is written and read in turns, so with the L3 every repeat
    hits whole, as with an infinite cache; L2 alone keeps almost nothing."""
    trace = tmp_path / "trace.jsonl"
    lines = [
        json.dumps({"timestamp": r, "input_length": 512 * 40, "output_length": 4,
                    "hash_ids": [(r % 2) * 1000 + i for i in range(40)]})
        for r in range(6)
    ]  # fmt: skip
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.json"
    main(["bench", "cache", "--trace", str(trace), "--workers", "1", "--servers", "1",
          "--capacities", "8", "--json", str(out), "--no-progress"])  # fmt: skip
    payload = json.loads(out.read_text())
    (entry,) = payload["capacities"]
    assert payload["infinite"]["block_hit_rate"] == 160 / 240
    assert entry["shared"]["block_hit_rate"] < 0.1
    assert entry["shared_l3"]["block_hit_rate"] == 160 / 240
    assert entry["shared_l3"]["wrong_pages"] == 0


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
    tiers = make_tiers(agent, 2, 4, 256, stores)
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


def test_bench_cache_reports_every_policy_and_belady(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    out, png = tmp_path / "out.json", tmp_path / "hit.png"
    main(["bench", "cache", "--trace", str(trace), "--workers", "2", "--servers", "1",
          "--capacities", "12,30", "--policies", "prefix-lirs",
          "--cost-rounds", "1", "--json", str(out), "--plot", str(png),
          "--no-progress"])  # fmt: skip
    payload = json.loads(out.read_text())
    default = payload["default_policy"]
    assert default == DEFAULT_POLICY
    names = {"lru", default, "prefix-lirs"}
    assert set(payload["online_policies"]) == names
    for entry in payload["capacities"]:
        rates = {n: r["block_hit_rate"] for n, r in entry["policies"].items()}
        assert set(rates) == names | {"belady", *ORACLES}
        # One server: Belady is the optimum (tests/cache/test_eviction.py).
        assert all(rates["belady"] >= rate - 1e-12 for rate in rates.values())
        assert entry["shared"] == entry["policies"][default]
        assert set(entry["policies_l3"]) == names | {"belady"}
        assert set(entry["gap_closed"]) == names | set(ORACLES)
    cost = payload["index_cost"]
    assert cost["baseline"] == "lru" and cost["lru"]["lookup_ratio"] == 1.0
    assert cost[default]["ns_per_lookup"] > 0 and cost[default]["gc_off"]["ns_per_insert"] > 0
    assert cost["lru"]["insert_ratio_min"] == cost["lru"]["insert_ratio_max"] == 1.0
    assert cost[default]["lookup_ratio_min"] <= cost[default]["lookup_ratio_max"]
    # The compiled policies' Python references are timed beside them.
    assert cost["prefix-lru-reference"]["ns_per_lookup"] > 0
    assert cost["prefix-lirs-reference"]["ns_per_lookup"] > 0
    printed = capsys.readouterr().out
    assert "belady" in printed and "ns/page looked up" in printed
    assert "oracle-count gap closed" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cache_refuses_an_unknown_policy(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, 10)
    with pytest.raises(SystemExit, match="unknown policies"):
        main(["bench", "cache", "--trace", str(trace), "--policies", "fifo", "--no-progress"])


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("--capacities", "0", "must be comma-separated integers >= 1"),
        ("--capacities", "8,,30", "must be comma-separated integers >= 1"),
        ("--capacities", "x", "must be comma-separated integers >= 1"),
        ("--limit", "-3", "must be an integer >= 1"),
        ("--servers", "0", "must be comma-separated integers >= 1"),
        ("--workloads", "flood", "unknown workloads ['flood']"),
        ("--workers", "0", "must be an integer >= 1"),
        ("--block-tokens", "0", "must be an integer >= 1"),
        ("--cost-rounds", "0", "must be an integer >= 1"),
        ("--slot-bytes", "0", "must be an integer >= 1"),
        ("--l3-pages", "0", "must be an integer >= 1"),
        ("--l3", "bogus", "must be file, none, valkey-cluster or"),
        ("--l3", "valkey://", "must be file, none, valkey-cluster or"),
    ],
)
def test_bench_cache_refuses_bad_flags_by_name(tmp_path, capsys, flag, value, reason):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, 10)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit):
        main(["bench", "cache", "--trace", str(trace), "--json", str(out), flag, value])
    assert f"argument {flag}: {reason}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("content", "reason"),
    [(None, "No such file"), ("", "no requests"), ('{"a":\n', "line 1: not JSON"),
     ('{"hash_ids": [1]}\n[1, 2]\n', "line 2: not a JSON object")],
)  # fmt: skip
def test_bench_cache_refuses_an_unreadable_trace_naming_it(tmp_path, content, reason):
    trace = tmp_path / "trace.jsonl"
    if content is not None:
        trace.write_text(content)
    with pytest.raises(SystemExit, match=f"bench cache: {trace}: .*{reason}"):
        main(["bench", "cache", "--trace", str(trace), "--l3", "none", "--no-progress"])


def test_agentic_trace_is_the_demo_workload_in_mooncake_format(tmp_path, capsys):
    out = tmp_path / "agentic.jsonl"
    main(["bench", "agentic-trace", "--out", str(out), "--sessions", "3", "--concurrent", "2",
          "--turns", "3", "--system-tokens", "1024", "--user-tokens", "300",
          "--tool-tokens", "512", "--answer-tokens", "16", "--block-tokens", "256"])  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 9 and "9 requests" in capsys.readouterr().out
    # Think times of 2 ms: a request a millisecond while two sessions are
    # live, one every 2 ms once the last one runs alone.
    assert [r["timestamp"] for r in records] == [0, 1, 2, 3, 4, 5, 6, 8, 10]
    # The shared system prompt: 4 blocks, the same ids in every request.
    assert all(r["hash_ids"][:4] == [0, 1, 2, 3] for r in records)
    # Two sessions live at once, turns round robin; the third starts when one ends.
    sessions: dict[int, list[dict]] = {}
    for r in records:
        owner = r["hash_ids"][4]
        sessions.setdefault(owner, []).append(r)
    assert sorted(len(turns) for turns in sessions.values()) == [3, 3, 3]
    for turns in sessions.values():
        for before, after in itertools.pairwise(turns):
            assert after["input_length"] == before["input_length"] + 512 + 16
            assert after["hash_ids"][: len(before["hash_ids"])] == before["hash_ids"]
            assert len(after["hash_ids"]) == after["input_length"] // 256
    assert [len(r["hash_ids"]) for r in records[:3]] == [5, 5, 7]


def test_agentic_trace_with_think_jitter_interleaves_closed_loop_sessions(tmp_path):
    def trace(name, *extra):
        out = tmp_path / name
        main(["bench", "agentic-trace", "--out", str(out), "--sessions", "12",
              "--concurrent", "4", "--turns", "6", "--system-tokens", "1024",
              "--user-tokens", "300", "--tool-tokens", "512", "--answer-tokens", "16",
              "--block-tokens", "256", *extra])  # fmt: skip
        return [json.loads(line) for line in out.read_text().splitlines()]

    steady = trace("steady.jsonl")
    jittered = trace("jittered.jsonl", "--think-jitter", "1.0")
    assert trace("again.jsonl", "--think-jitter", "1.0") == jittered  # seeded
    assert trace("other.jsonl", "--think-jitter", "1.0", "--seed", "1") != jittered
    assert len(jittered) == len(steady) == 72
    assert [r["timestamp"] for r in steady] == list(range(72))
    stamps = [r["timestamp"] for r in jittered]
    assert stamps == sorted(stamps)

    def turns_by_session(records):
        sessions: dict[int, list[int]] = {}
        for number, r in enumerate(records):
            sessions.setdefault(r["hash_ids"][4], []).append(number)
        return sessions

    # The same sessions, each still a growing chain of 6 turns ...
    sessions = turns_by_session(jittered)
    assert sorted(len(numbers) for numbers in sessions.values()) == [6] * 12
    for numbers in sessions.values():
        for before, after in itertools.pairwise(numbers):
            a, b = jittered[before]["hash_ids"], jittered[after]["hash_ids"]
            assert b[: len(a)] == a and len(b) > len(a)
    # ... at most 4 live at once ...
    spans = [(numbers[0], numbers[-1]) for numbers in sessions.values()]
    assert max(sum(first <= n <= last for first, last in spans) for n in range(72)) == 4

    # ... but no longer round robin: the other sessions' turns between two of
    # one session's vary, where round robin always has 3 between them.
    def gaps(records):
        sessions = turns_by_session(records).values()
        return {b - a - 1 for numbers in sessions for a, b in itertools.pairwise(numbers)}

    assert gaps(steady) == {3}
    assert len(gaps(jittered)) > 3


@pytest.mark.parametrize(
    ("flag", "value", "minimum"),
    [("--concurrent", "0", 1), ("--sessions", "-1", 1), ("--turns", "0", 1),
     ("--system-tokens", "0", 1), ("--answer-tokens", "x", 1), ("--block-tokens", "0", 1),
     ("--tool-tokens", "-5", 0), ("--user-tokens", "-1", 0)],
)  # fmt: skip
def test_agentic_trace_refuses_bad_counts_by_name(tmp_path, capsys, flag, value, minimum):
    out = tmp_path / "t.jsonl"
    with pytest.raises(SystemExit):
        main(["bench", "agentic-trace", "--out", str(out), flag, value])
    assert f"argument {flag}: must be an integer >= {minimum}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("sigma", ["-0.5", "nan", "abc"])
def test_agentic_trace_refuses_a_bad_think_jitter(tmp_path, sigma, capsys):
    with pytest.raises(SystemExit):
        out = str(tmp_path / "t.jsonl")
        main(["bench", "agentic-trace", "--out", out, "--think-jitter", sigma])
    assert "--think-jitter: must be a number >= 0" in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()


def test_each_file_l3_holds_its_servers_share_of_the_working_set(tmp_path):
    # The ring places pages unevenly: an even split of the working set would
    # overflow the busiest server's L3 and lose pages an infinite cache keeps.
    record_bytes = record.HEADER_BYTES + 256
    args = argparse.Namespace(l3="file", l3_pages=None, slot_bytes=256)
    stores = l3_stores(args, tmp_path, [3, 7], run=0)
    assert [s.config.capacity_bytes for s in stores] == [3 * record_bytes, 7 * record_bytes]
    args.l3_pages = 10
    stores = l3_stores(args, tmp_path, [3, 7], run=1)
    assert [s.config.capacity_bytes for s in stores] == [5 * record_bytes, 5 * record_bytes]
