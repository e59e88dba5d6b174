"""The slot board: a server's shared-memory map of sealed pages, read by
clients as a seqlock (generations), kept in step by the page index."""

import hashlib
import os

import numpy as np
import pytest

from kvrelay.cache.index import PageIndex
from kvrelay.cache.slot_board import WAYS, BoardError, BoardReader, SlotBoard


def _key(i: int, bucket_bits: bytes | None = None) -> bytes:
    digest = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()
    return digest if bucket_bits is None else bucket_bits + digest[8:]


@pytest.fixture
def board():
    board = SlotBoard(64)
    reader = BoardReader(board.path, board.size)
    yield board, reader
    reader.close()
    board.close()


def test_a_published_page_is_found_in_its_slot_until_withdrawn(board):
    board, reader = board
    keys = [_key(i) for i in range(5)]
    for slot, key in enumerate(keys):
        assert board.publish(key, 10 + slot)
    slots, gens = reader.find(keys)
    assert slots.tolist() == [10, 11, 12, 13, 14]
    assert (gens % 2 == 0).all()
    assert reader.unchanged(slots, gens)
    board.withdraw(keys[2], 12)
    assert not reader.unchanged(slots, gens)  # a reader that copied slot 12 meanwhile
    assert reader.find(keys) is None
    assert reader.find(keys[:2])[0].tolist() == [10, 11]
    # The slot holds another page now: the old key is not found in it.
    assert board.publish(_key(99), 12)
    assert reader.find([keys[2]]) is None
    assert reader.find([_key(99)])[0].tolist() == [12]


def test_nothing_is_found_before_a_publish_or_twice(board):
    board, reader = board
    assert reader.find([_key(1)]) is None
    board.withdraw(_key(1), 3)  # never published: nothing moves
    assert int(board.gens[3]) == 1
    assert board.publish(_key(1), 3)
    assert not board.publish(_key(1), 3)  # already readable
    assert int(board.gens[3]) == 2


def test_a_full_bucket_leaves_the_page_off_the_board(board):
    board, reader = board
    same = b"\x07" * 8  # every key in one bucket
    keys = [_key(i, same) for i in range(WAYS + 1)]
    assert all(board.publish(k, slot) for slot, k in enumerate(keys[:WAYS]))
    assert not board.publish(keys[WAYS], WAYS)
    assert board.full == 1
    assert reader.find(keys[:WAYS]) is not None
    assert reader.find(keys) is None
    board.withdraw(keys[0], 0)  # a way freed: the next one fits
    assert board.publish(keys[WAYS], WAYS)
    assert reader.find(keys[1:])[0].tolist() == list(range(1, WAYS + 1))


def test_a_file_that_is_not_a_board_is_refused(tmp_path):
    path = tmp_path / "not-a-board"
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(BoardError):
        BoardReader(str(path), 4096)
    board = SlotBoard(8)
    try:
        with pytest.raises(BoardError):
            BoardReader(board.path, board.size + 4096)  # larger than the memfd
        os.truncate(path, board.size)
        with open(path, "r+b") as f, open(board.path, "rb") as header:
            f.write(header.read(64))  # a board's header, another size
        with pytest.raises(BoardError):
            BoardReader(str(path), board.size - 8)
    finally:
        board.close()


def test_the_index_keeps_the_board_in_step(board):
    board, reader = board
    index = PageIndex(page_bytes=100)
    index.board = board
    a, b, c = _key(1), _key(2), _key(3)
    index.insert(a, 5)  # a reservation: not readable
    assert reader.find([a]) is None
    index.record_runs(a, [(0, 40)])
    assert reader.find([a]) is None
    assert index.record_runs(a, [(40, 60)])  # sealed
    assert reader.find([a])[0].tolist() == [5]
    index.insert(b, 6, sealed=True)  # promoted from L3: readable at once
    assert reader.find([a, b])[0].tolist() == [5, 6]
    gens = board.gens.copy()
    index.insert(c, 7)
    assert index.drop_abandoned() and np.array_equal(board.gens, gens)  # never readable
    victims = index.evict(1)
    assert reader.find([victims[0].key]) is None
    left = b if victims[0].key == a else a
    index.remove(left)
    assert reader.find([left]) is None
    assert (board.gens[[5, 6]] % 2 == 1).all()  # both slots free for writers


def test_the_compiled_find_answers_as_its_reference():
    from kvrelay.cache import slot_board

    if slot_board.board_find is None:
        pytest.skip("kvrelay.transfer._runcopy is not built")
    rng = np.random.default_rng(7)
    board = SlotBoard(256)
    reader = BoardReader(board.path, board.size)
    crowded = [bytes(rng.integers(0, 256, 8, dtype=np.uint8)) for _ in range(4)]
    keys = [_key(i, crowded[i % 4] if i % 3 == 0 else None) for i in range(600)]
    held: dict[int, bytes] = {}  # slot -> key
    outcomes = set()
    try:
        for step in range(300):
            slot = int(rng.integers(0, 256))
            if slot in held:
                board.withdraw(held.pop(slot), slot)
            else:
                key = keys[int(rng.integers(0, len(keys)))]
                if key not in held.values() and board.publish(key, slot):
                    held[slot] = key
            if step % 7 == 0:  # a stray entry: out of range, or naming another key's slot
                at = (int(rng.integers(0, board.buckets)), int(rng.integers(0, WAYS)))
                board.table[at] = int(rng.choice([-5, 257, 10_000, 3]))
            asked = list(held.values())[-8:]  # readable, unless a stray entry hides one
            if step % 2:
                asked += [keys[int(i)] for i in rng.integers(0, len(keys), 8)]
            digests = b"".join(asked)
            got, want = np.zeros((len(asked), 2), np.uint64), np.zeros((len(asked), 2), np.uint64)
            compiled = slot_board.board_find(
                reader.table.ctypes.data, reader.gens.ctypes.data, reader.keys.ctypes.data,
                reader.num_slots, reader.buckets, digests, got,
            )  # fmt: skip
            reference = slot_board.find_reference(
                reader.table, reader.gens, reader._keys64, digests, want
            )
            assert compiled == reference, step
            outcomes.add(compiled)
            if compiled:
                assert np.array_equal(got, want), step
        assert outcomes == {True, False}
    finally:
        reader.close()
        board.close()
