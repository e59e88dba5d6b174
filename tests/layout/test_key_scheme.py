"""The "sglang" key scheme: SGLang's HiCache page chain rooted in the namespace,
so a kvrelay worker keys pages from token ids as the SGLang adapter does."""

import hashlib
import struct
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.layout import LayoutError
from kvrelay.layout.keys import PageKeyChain, scheme_page_keys, sglang_chain
from tests.layout.strategies import TINY_SPEC

KVRELAY = TINY_SPEC
SGLANG = replace(KVRELAY, key_scheme="sglang")


def test_known_answer_against_an_independent_sglang_chain():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    ns = SGLANG.namespace()
    expect, link = [], b""
    for page in ([1, 2, 3, 4], [5, 6, 7, 8]):
        link = hashlib.sha256(link + struct.pack("<4I", *page)).digest()
        expect.append(hashlib.sha256(ns + b"sglang-hicache-page-v1" + link).digest())
    assert SGLANG.page_keys(tokens) == expect  # the trailing partial page has no key
    assert scheme_page_keys("sglang", ns, tokens, 4) == expect


def test_the_scheme_is_in_the_namespace_only_when_not_the_default():
    assert "key_scheme" not in KVRELAY.identity_fields()
    assert SGLANG.identity_fields()["key_scheme"] == "sglang"
    assert SGLANG.namespace() != KVRELAY.namespace()
    assert set(SGLANG.page_keys(range(16))).isdisjoint(KVRELAY.page_keys(range(16)))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.lists(st.integers(0, 12), max_size=5))
def test_a_chain_extended_in_steps_equals_one_from_scratch(tokens, cuts):
    """As the engine extends a sequence's keys while decode fills pages."""
    for spec in (KVRELAY, SGLANG):
        chain = spec.key_chain()
        done = 0
        for cut in sorted(cuts):
            end = min(len(tokens), done + cut * spec.page_size)
            chain.extend(tokens[done:end])
            done = end
        chain.extend(tokens[done:])
        assert chain.keys == spec.page_keys(tokens)


def test_sglang_chain_is_seeded_by_its_prior():
    tokens = list(range(8))
    seed = hashlib.sha256(b"seed").digest()
    seeded = sglang_chain(tokens, 4, seed)
    assert seeded[0] == hashlib.sha256(seed + struct.pack("<4I", 0, 1, 2, 3)).digest()
    assert seeded != sglang_chain(tokens, 4)


def test_an_sglang_chain_is_not_extended_from_a_key_and_schemes_are_checked():
    with pytest.raises(LayoutError, match="key_chain"):
        SGLANG.page_keys([1, 2, 3, 4], parent=SGLANG.page_keys(range(4))[0])
    with pytest.raises(LayoutError, match="key_scheme"):
        replace(KVRELAY, key_scheme="vllm")
    with pytest.raises(LayoutError, match="key_scheme"):
        PageKeyChain("vllm", KVRELAY.namespace(), 4)
