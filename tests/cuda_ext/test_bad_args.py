"""Bad calls raise a clear Python error before any byte moves, in every implementation."""

import pytest
import torch

from tests.cuda_ext.impls import IMPLS

# "cuda" copies (and so reshapes) its arguments: bad layouts are tested on the
# host implementations, whose checks are the same C++ code.
HOST_IMPLS = sorted(name for name in IMPLS if name != "cuda")

L, H, KD, VD, PS, SLOTS = 2, 2, 4, 4, 4, 32


def good_call():
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(SLOTS, H, KD, generator=gen) for _ in range(L)]
    v = [torch.randn(SLOTS, H, VD, generator=gen) for _ in range(L)]
    pages = torch.zeros(3, H * L * PS * (KD + VD) * 4, dtype=torch.uint8)
    ids = torch.tensor([2, 0])
    slots = torch.arange(8).view(2, PS)
    return dict(
        k=k, v=v, pages=pages, ids=ids, slots=slots, ph=H, pl=L, phs=0, pls=0, poolh=0, nh=H
    )


def set_(key, value):
    return lambda c: c.update({key: value(c) if callable(value) else value})


BAD = {
    "pages not uint8": (set_("pages", lambda c: c["pages"].float()), TypeError, "uint8"),
    "pages 1-D": (set_("pages", lambda c: c["pages"].flatten()), ValueError, "page_bytes"),
    "pages row size": (set_("pages", lambda c: c["pages"][:, :-4]), ValueError, "bytes"),
    "slot past pool": (set_("slots", lambda c: c["slots"] + SLOTS - 4), IndexError, "slot_mapping"),
    "slot below -1": (
        set_("slots", torch.tensor([[0, 1, 2, -2], [3, 4, 5, 6]])),
        IndexError,
        "slot_mapping",
    ),
    "page id past arena": (set_("ids", torch.tensor([3, 0])), IndexError, "page_ids"),
    "negative page id": (set_("ids", torch.tensor([-1, 0])), IndexError, "page_ids"),
    "slots int32": (set_("slots", lambda c: c["slots"].int()), TypeError, "int64"),
    "page ids int32": (set_("ids", lambda c: c["ids"].int()), TypeError, "int64"),
    "slots not contiguous": (
        set_("slots", torch.arange(16).view(4, 4).t()[:2]),
        ValueError,
        "contiguous",
    ),
    "slots rows != pages": (set_("slots", torch.arange(12).view(3, PS)), ValueError, "pages"),
    "layer 2-D": (set_("k", lambda c: [t.flatten(1) for t in c["k"]]), ValueError, "head_dim"),
    "K/V dtypes differ": (set_("v", lambda c: [t.double() for t in c["v"]]), TypeError, "dtype"),
    "head_dim not contiguous": (
        set_("k", lambda c: [torch.randn(SLOTS, KD, H).transpose(1, 2) for _ in range(L)]),
        ValueError,
        "contiguous",
    ),
    "layers differ": (
        set_("k", lambda c: [c["k"][0], torch.randn(SLOTS + 1, H, KD)]),
        ValueError,
        "unlike",
    ),
    "V layer count": (set_("v", lambda c: c["v"][:1]), ValueError, "layers"),
    "no layers": (lambda c: c.update(k=[], v=[]), ValueError, "empty"),
    "heads outside page": (set_("phs", 1), IndexError, "heads"),
    "heads outside pool": (set_("poolh", 1), IndexError, "pool heads"),
    "layers outside page": (set_("pls", 1), IndexError, "layers"),
    "zero heads": (set_("nh", 0), ValueError, "num_heads"),
    "duplicate page ids": (set_("ids", torch.tensor([1, 1])), ValueError, "duplicate"),
}


def call(impl, c, op):
    fn = getattr(impl, op)
    fn(
        c["k"],
        c["v"],
        c["pages"],
        c["ids"],
        c["slots"],
        c["ph"],
        c["pl"],
        c["phs"],
        c["pls"],
        c["poolh"],
        c["nh"],
    )


@pytest.mark.parametrize("impl", HOST_IMPLS)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_gather_raises_and_writes_nothing(impl, case):
    mutate, error, message = BAD[case]
    c = good_call()
    mutate(c)
    before = c["pages"].clone()
    with pytest.raises(error, match=message):
        call(IMPLS[impl](), c, "gather_pages")
    assert torch.equal(c["pages"], before)


@pytest.mark.parametrize("impl", HOST_IMPLS)
def test_duplicate_slots_in_scatter_are_rejected(impl):
    c = good_call()
    c["slots"] = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 3]])
    before = [t.clone() for t in c["k"]]
    with pytest.raises(ValueError, match="duplicate slots"):
        call(IMPLS[impl](), c, "scatter_pages")
    assert all(torch.equal(a, b) for a, b in zip(c["k"], before, strict=True))


@pytest.mark.parametrize("impl", HOST_IMPLS)
def test_good_call_passes(impl):
    """The fixture the bad cases mutate is itself valid, in both directions."""
    c = good_call()
    call(IMPLS[impl](), c, "gather_pages")
    assert c["pages"][[0, 2]].ne(0).any()
    call(IMPLS[impl](), c, "scatter_pages")


def test_non_tensor_layer_is_a_type_error():
    c = good_call()
    c["k"] = [c["k"][0], "not a tensor"]
    for impl in ("cpp", "numba", "dispatch"):
        with pytest.raises(TypeError):
            call(IMPLS[impl](), c, "gather_pages")
