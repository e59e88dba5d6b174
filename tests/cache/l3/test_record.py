import hashlib

import pytest

from kvrelay.cache.l3 import record

KEY = hashlib.sha256(b"k").digest()
OTHER = hashlib.sha256(b"o").digest()
PAGE = bytes(range(256)) * 5


def test_round_trip():
    blob = record.encode(KEY, PAGE)
    assert len(blob) == record.HEADER_BYTES + len(PAGE)
    assert bytes(record.decode(KEY, blob)) == PAGE
    assert bytes(record.decode(KEY, record.encode(KEY, b""))) == b""


def test_every_single_byte_flip_is_caught():
    blob = bytearray(record.encode(KEY, PAGE[:64]))
    for i in range(len(blob)):
        blob[i] ^= 0x10
        assert record.decode(KEY, bytes(blob)) is None, i
        blob[i] ^= 0x10
    assert record.decode(KEY, bytes(blob)) is not None


def test_truncated_extended_or_foreign_records_are_rejected():
    blob = record.encode(KEY, PAGE)
    assert record.decode(KEY, blob[:-1]) is None
    assert record.decode(KEY, blob + b"\0") is None
    assert record.decode(KEY, blob[:10]) is None
    assert record.decode(OTHER, blob) is None  # stored under the wrong key
    assert record.decode(KEY, blob, OTHER) is None  # or in the wrong namespace


def test_namespace_is_part_of_the_record():
    blob = record.encode(KEY, PAGE, OTHER)
    assert len(blob) == 96 + len(PAGE)
    assert bytes(record.decode(KEY, blob, OTHER)) == PAGE
    assert record.decode(KEY, blob) is None
    # b"" (no namespace) is stored as all zeros.
    assert bytes(record.decode(KEY, record.encode(KEY, PAGE), record.NO_NAMESPACE)) == PAGE
    with pytest.raises(ValueError):
        record.encode(KEY, PAGE, b"short")


def test_version_1_records_are_rejected():
    blob = bytearray(record.encode(KEY, PAGE))
    blob[4] = 1
    assert record.decode(KEY, bytes(blob)) is None
