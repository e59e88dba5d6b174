"""gather/scatter_pages: every implementation against the torch-indexing oracle, bit for bit."""

import os
import subprocess
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch

from kvrelay.cuda_ext import slot_mapping_from_block_table, torch_ref
from tests.cuda_ext.impls import DTYPES, IMPLS, compiled, random_pool

# "cuda": the same cases through the CUDA kernel, whenever a GPU is present.
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
IMPL_NAMES = ["cpp", "numba", "dispatch", CUDA]
PAGE_SIZES = [(1, 16), (16, 16), (64, 16), (1, 64), (16, 64), (64, 64)]  # (engine, unified)


@dataclass
class Case:
    """A request's pages in a randomly fragmented engine pool, and a rectangle to move."""

    k: list
    v: list
    slots: torch.Tensor
    page_ids: torch.Tensor
    arena_pages: int
    page_heads: int
    page_layers: int
    page_head_start: int
    page_layer_start: int
    pool_head_start: int
    num_heads: int

    def args(self, pages):
        return (
            self.k,
            self.v,
            pages,
            self.page_ids,
            self.slots,
            self.page_heads,
            self.page_layers,
            self.page_head_start,
            self.page_layer_start,
            self.pool_head_start,
            self.num_heads,
        )

    def page_bytes(self):
        rows = self.k[0].size(2) * self.k[0].element_size()
        if self.v:
            rows += self.v[0].size(2) * self.v[0].element_size()
        return self.page_heads * self.page_layers * self.slots.size(1) * rows

    def new_pages(self, gen):
        return torch.randint(
            0, 256, (self.arena_pages, self.page_bytes()), dtype=torch.uint8, generator=gen
        )


def make_case(
    seed,
    dtype=torch.bfloat16,
    engine_page=16,
    page_size=16,
    num_tokens=None,
    pool_heads=4,
    k_dim=8,
    v_dim=8,
    layers=3,
    rect="full",
    layers_in_slot=False,
):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = num_tokens or 3 * page_size - 5  # a partial last page
    engine_pages = -(-num_tokens // engine_page) + 7
    num_slots = engine_pages * engine_page
    block_table = torch.randperm(engine_pages, generator=gen)
    slots = slot_mapping_from_block_table(block_table, engine_page, num_tokens, page_size)
    k = random_pool(gen, num_slots, pool_heads, k_dim, dtype, layers, layers_in_slot)
    v = []
    if v_dim:
        v = random_pool(gen, num_slots, pool_heads, v_dim, dtype, layers, layers_in_slot)
    num_pages = slots.size(0)
    arena_pages = num_pages + 4
    page_ids = torch.randperm(arena_pages, generator=gen)[:num_pages]
    if rect == "full":
        geometry = (pool_heads, layers, 0, 0, 0, pool_heads)
    else:
        # This pool is one TP shard: heads [1, 3) of its 4 go to heads [5, 7) of
        # an 8-head page, layers to [2, 5) of a 6-layer page.
        geometry = (8, layers + 3, 5, 2, 1, 2)
    return Case(k, v, slots, page_ids, arena_pages, *geometry)


def check_gather(impl_name, case, seed=0):
    impl = IMPLS[impl_name]()
    gen = torch.Generator().manual_seed(seed)
    start = case.new_pages(gen)
    want, got = start.clone(), start.clone()
    torch_ref.gather_pages(*case.args(want))
    impl.gather_pages(*case.args(got))
    assert torch.equal(got, want)
    assert not torch.equal(want, start)  # the oracle did move bytes


def check_scatter(impl_name, case, seed=0):
    impl = IMPLS[impl_name]()
    gen = torch.Generator().manual_seed(seed)
    pages = case.new_pages(gen)
    base_k = [t.clone() for t in case.k]
    base_v = [t.clone() for t in case.v]

    def run(fn):
        case.k[:] = [t.clone() for t in base_k]
        case.v[:] = [t.clone() for t in base_v]
        fn(*case.args(pages))
        return [t.view(torch.uint8).clone() for t in case.k + case.v]

    want = run(torch_ref.scatter_pages)
    got = run(impl.scatter_pages)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not all(
        torch.equal(a, b.view(torch.uint8)) for a, b in zip(want, base_k + base_v, strict=True)
    )


@pytest.mark.parametrize("impl", IMPL_NAMES)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize(("engine_page", "page_size"), PAGE_SIZES)
def test_gather_and_scatter_match_the_oracle(impl, dtype, engine_page, page_size):
    seed = zlib.crc32(f"{dtype}/{engine_page}/{page_size}".encode())
    case = make_case(seed, DTYPES[dtype], engine_page, page_size)
    check_gather(impl, case, seed)
    check_scatter(impl, case, seed)


@pytest.mark.parametrize("impl", IMPL_NAMES)
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8-as-uint8"])
@pytest.mark.parametrize(("engine_page", "page_size"), [(1, 16), (16, 64)])
def test_partial_rectangle(impl, dtype, engine_page, page_size):
    case = make_case(7, DTYPES[dtype], engine_page, page_size, rect="partial")
    check_gather(impl, case)
    check_scatter(impl, case)


@pytest.mark.parametrize("impl", IMPL_NAMES)
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8-as-uint8"])
@pytest.mark.parametrize(("engine_page", "page_size"), [(1, 64), (64, 16)])
def test_mla_has_one_head_and_no_v(impl, dtype, engine_page, page_size):
    # DeepSeek-style latent: 512 + 64 rope dims in one row, no V tensor.
    case = make_case(11, DTYPES[dtype], engine_page, page_size, pool_heads=1, k_dim=576, v_dim=0)
    check_gather(impl, case)
    check_scatter(impl, case)


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_k_and_v_head_dims_may_differ_and_rows_of_odd_size(impl):
    case = make_case(3, torch.float16, 16, 16, k_dim=24, v_dim=5)
    check_gather(impl, case)
    check_scatter(impl, case)


@pytest.mark.parametrize("impl", IMPL_NAMES)
@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"rect": "partial"},
        {"pool_heads": 1, "k_dim": 576, "v_dim": 0},  # MLA
        {"k_dim": 24, "v_dim": 8},  # K and V rows of other sizes
        {"engine_page": 1, "page_size": 64, "layers": 5},
    ],
    ids=["full", "partial", "mla", "k_not_v", "scattered_slots"],
)
def test_pools_holding_every_layer_in_a_slot(impl, shape):
    """SGLang's page_first pools ([slot][layer][head] rows), which gather
    moves token by token over every layer."""
    case = make_case(17, torch.bfloat16, **{"engine_page": 16, **shape}, layers_in_slot=True)
    check_gather(impl, case)
    check_scatter(impl, case)


@pytest.mark.parametrize("impl", ["cpp", "dispatch", CUDA])
def test_more_layers_than_one_launch(impl):
    # kMaxLayersPerLaunch is 128: the compiled op splits the call in chunks.
    case = make_case(5, torch.float16, 16, 16, pool_heads=1, k_dim=2, v_dim=2, layers=131)
    check_gather(impl, case)
    check_scatter(impl, case)


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_strided_pools_and_padded_arena_rows(impl):
    """Head-major pools (slot stride = head_dim) and arena rows with padding."""
    gen = torch.Generator().manual_seed(9)
    heads, slots_n, dim, layers, page_size = 3, 80, 4, 2, 16
    # Stored [heads, slots, dim]; viewed [slots, heads, dim] with non-standard strides.
    k = [torch.randn(heads, slots_n, dim, generator=gen).transpose(0, 1) for _ in range(layers)]
    v = [torch.randn(heads, slots_n, dim, generator=gen).transpose(0, 1) for _ in range(layers)]
    slots = torch.randperm(slots_n, generator=gen)[: 2 * page_size].view(2, page_size).clone()
    page_bytes = heads * layers * page_size * 2 * dim * 4
    wide = torch.zeros(3, page_bytes + 40, dtype=torch.uint8)
    want, got = wide.clone(), wide.clone()
    ids = torch.tensor([2, 0])
    args = (k, v, None, ids, slots, heads, layers, 0, 0, 0, heads)

    def with_pages(pages):
        return (*args[:2], pages[:, :page_bytes], *args[3:])

    torch_ref.gather_pages(*with_pages(want))
    IMPLS[impl]().gather_pages(*with_pages(got))
    assert torch.equal(got, want) and want[:, page_bytes:].eq(0).all()
    k2 = [torch.zeros(heads, slots_n, dim).transpose(0, 1) for _ in range(layers)]
    v2 = [torch.zeros(heads, slots_n, dim).transpose(0, 1) for _ in range(layers)]
    IMPLS[impl]().scatter_pages(k2, v2, got[:, :page_bytes], *args[3:])
    used = slots.flatten()
    assert all(torch.equal(a[used], b[used]) for a, b in zip(k + v, k2 + v2, strict=True))


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_empty_request_is_a_no_op(impl):
    case = make_case(1)
    case.page_ids = case.page_ids[:0]
    case.slots = case.slots[:0]
    pages = case.new_pages(torch.Generator().manual_seed(0))
    before = pages.clone()
    IMPLS[impl]().gather_pages(*case.args(pages))
    assert torch.equal(pages, before)


def test_slot_mapping_from_block_table():
    table = torch.tensor([5, 2, 7])
    got = slot_mapping_from_block_table(table, 4, 10, 8)
    expect = [table[i // 4].item() * 4 + i % 4 for i in range(10)] + [-1] * 6
    assert got.tolist() == [expect[:8], expect[8:]]
    with pytest.raises(ValueError, match="need 3"):
        slot_mapping_from_block_table(table[:2], 4, 10, 8)


@pytest.mark.parametrize("layers_in_slot", [False, True])
@pytest.mark.parametrize("k_dim", [128, 100])  # 100 bf16 = 200-byte rows: no streaming stores
def test_large_call_takes_the_threaded_and_streaming_paths(k_dim, layers_in_slot):
    """Over 16 MiB the compiled op splits pages over threads and streams its stores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        case = make_case(
            13,
            torch.bfloat16,
            16,
            64,
            num_tokens=2048 - 7,
            pool_heads=8,
            k_dim=k_dim,
            v_dim=128,
            layers=4,
            layers_in_slot=layers_in_slot,
        )
        assert case.page_bytes() * case.slots.size(0) > 16 << 20
        check_gather("dispatch", case)
        check_scatter("dispatch", case)
    finally:
        torch.set_num_threads(previous)


def test_the_baseline_loops_pass_the_same_cases():
    """CPUs without AVX2 run the plain x86-64 build of the loops; an AVX2
    machine runs the other build, so this file runs again with it turned off."""
    module = compiled()
    if os.environ.get("KVRELAY_PAGE_COPY_LOOPS") == "baseline":
        assert module.cpu_page_copy_loops() == "baseline"
        return
    env = {**os.environ, "KVRELAY_PAGE_COPY_LOOPS": "baseline"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "cpp or dispatch or baseline or large"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
