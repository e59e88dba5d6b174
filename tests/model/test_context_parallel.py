"""Context parallelism against HF transformers (float64, SDPA): CP 2 and 4 alone,
CP 2 with TP=2 and with PP=2, CP 4 with TP=2, give the prefill logits and greedy tokens of HF and of
CP=1 (a cached prefix too); the pages a CP group writes are CP=1's pages, each
written by one CP rank; a prefix written at CP=2 is a full hit for CP=1, CP=4,
TP=2 and PP=2."""

import pytest
import torch

from kvrelay.layout import ParallelConfig
from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.context_parallel import page_zigzag_chunks, zigzag_chunks
from kvrelay.model.page_export import export_prefix, import_prefix
from kvrelay.model.parallel import ParallelEngine
from tests.model.oracle import hf_greedy, hf_model
from tests.support.models import prompt_tokens

PAGE = 16
# 10 full pages and a partial 11th: CP=4's 8 page-aligned chunks, cold and
# after the cached prefix (9 pages), give every rank tokens.
PROMPT = 10 * PAGE + 9
PAGES = 11
CACHED = 2 * PAGE + 8  # a cached prefix that ends inside page 2
NEW = 24
EXACT = 1e-9
# The process groups whose pages are compared byte for byte across CP degrees.
BYTE_EXACT_GROUP = dict(
    dtype="float64", page_size=PAGE, batch_invariant_attention=True, num_pages=32, timeout_s=240
)


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("tokens", [1, 5, 8, 73, 200])
def test_zigzag_gives_rank_r_chunks_r_and_2c_minus_1_minus_r(tokens, cp):
    chunks = zigzag_chunks(tokens, cp)
    covered = sorted(t for rank in chunks for a, b in rank for t in range(a, b))
    assert covered == list(range(tokens))
    sizes = [b - a for rank in chunks for a, b in rank]
    assert max(sizes) - min(sizes) <= 1
    if tokens >= 2 * cp:
        # Chunk r and chunk 2C-1-r: causal work (sum of positions + 1) is even.
        work = [sum(t + 1 for a, b in rank for t in range(a, b)) for rank in chunks]
        assert max(work) - min(work) <= 2 * tokens
        for mine in chunks:
            assert len(mine) == 2 and mine[0][1] <= mine[1][0]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(("cached", "length"), [(0, PROMPT), (CACHED, PROMPT - CACHED), (5, 140)])
def test_cp_chunks_are_cut_on_page_boundaries(cached, length, cp):
    chunks = page_zigzag_chunks(cached, length, PAGE, cp)
    covered = sorted(t for rank in chunks for a, b in rank for t in range(a, b))
    assert covered == list(range(length))
    assert all(len(mine) == 2 for mine in chunks)  # every rank gets tokens here
    for a, b in (c for rank in chunks for c in rank):
        assert a == 0 or (cached + a) % PAGE == 0
        assert b == length or (cached + b) % PAGE == 0


@pytest.mark.parametrize("invariant", [False, True])
def test_batch_invariant_attention_splits_rows_as_cp_does(invariant):
    """Rows [cached, context) attended in one forward vs in CP's page-aligned
    pieces (each the tail of a context ending at its end): the same bits with
    batch-invariant attention; the one-call kernel rounds differently."""
    from kvrelay.model.attention import AttentionBatch
    from kvrelay.model.paged_attention import PagedOnlineSoftmaxBackend

    gen = torch.Generator().manual_seed(5)
    cached, length, pages = 21, 9 * PAGE + 3, 12
    k, v = (torch.randn(pages * PAGE, 2, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    q = torch.randn(length, 8, 8, generator=gen, dtype=torch.float64)
    table = torch.randperm(pages, generator=gen)
    backend = PagedOnlineSoftmaxBackend(3 * PAGE, batch_invariant=invariant)
    whole = backend.attend(q, k, v, AttentionBatch((0,), (length,), (cached + length,),
                                                   (table,), PAGE), 0.3)  # fmt: skip
    pieces = torch.empty_like(whole)
    for a, b in (c for rank in page_zigzag_chunks(cached, length, PAGE, 4) for c in rank):
        batch = AttentionBatch((0,), (b - a,), (cached + b,), (table,), PAGE)
        pieces[a:b] = backend.attend(q[a:b], k, v, batch, 0.3)
    assert torch.equal(pieces, whole) == invariant
    torch.testing.assert_close(pieces, whole, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def oracle(model_dirs):
    """HF's prefill logits and greedy tokens; CP=1's unified pages of the prompt."""
    model_dir = model_dirs("parallel")
    prompt = prompt_tokens(PROMPT, seed=31)
    hf = hf_greedy(hf_model(model_dir), prompt, NEW)
    assert len(set(hf.tokens)) >= 12
    engine = load_engine(
        model_dir, dtype="float64", page_size=PAGE, batch_invariant_attention=True, num_pages=32
    )
    engine.generate([Request(prompt, SamplingParams(1))])
    arena = torch.zeros(PAGES, engine.spec.page_bytes, dtype=torch.uint8)
    export_prefix(engine, prompt, arena)
    return model_dir, prompt, hf, arena


def run_group(group, prompt, hf) -> torch.Tensor:
    """Cold and warm (cached prefix) runs against HF; returns the group's pages."""
    cold = group.generate([Request(prompt, SamplingParams(NEW), return_logits=True)])[0]
    assert cold.cached_tokens == 0
    assert max_diff(cold.prompt_logits, hf.prompt_logits) < EXACT
    assert cold.tokens == hf.tokens
    group.clear_cache()
    group.generate([Request(prompt[:CACHED], SamplingParams(1))])
    warm = group.generate([Request(prompt, SamplingParams(NEW), return_logits=True)])[0]
    assert warm.cached_tokens == CACHED  # only the suffix is split
    assert max_diff(warm.prompt_logits, hf.prompt_logits[CACHED:]) < EXACT
    assert warm.tokens == hf.tokens
    group.clear_cache()
    group.generate([Request(prompt, SamplingParams(1))])
    return group.export_prefix(prompt)


def assert_pages_equal(pages, want):
    """Byte for byte: with batch-invariant attention (query blocks and key
    chunks cut at global positions), CP's whole-page chunks compute CP=1's bits."""
    assert pages.shape == want.shape
    assert bool((pages != 0).any(dim=1).all())  # every page written
    assert torch.equal(pages, want)


def generate_from_pages(engine_or_group, prompt, hf):
    """As a decode worker: the prompt's pages imported, the prompt and the first
    token fed; nothing of the prompt is computed."""
    again = engine_or_group.generate([Request(prompt + hf.tokens[:1], SamplingParams(NEW - 1))])[0]
    assert again.cached_tokens == PROMPT
    assert again.tokens == hf.tokens[1:]


@pytest.fixture(scope="module")
def cp2_pages(oracle):
    model_dir, prompt, hf, cp1_pages = oracle
    with ParallelEngine(model_dir, cp=2, **BYTE_EXACT_GROUP) as group:
        pages = run_group(group, prompt, hf)
        # CP=1's pages read by the CP group (every CP rank imports every page).
        group.clear_cache()
        assert group.import_prefix(prompt, cp1_pages) == PAGES
        generate_from_pages(group, prompt, hf)
    return pages


def test_cp2_matches_hf_and_writes_cp1s_pages(oracle, cp2_pages):
    assert_pages_equal(cp2_pages, oracle[3])


def test_a_prefix_written_at_cp2_is_a_full_hit_for_cp1(oracle, cp2_pages):
    model_dir, prompt, hf, _ = oracle
    engine = load_engine(
        model_dir, dtype="float64", page_size=PAGE, batch_invariant_attention=True, num_pages=32
    )
    assert import_prefix(engine, prompt, cp2_pages) == PAGES
    generate_from_pages(engine, prompt, hf)


def test_each_page_is_exported_by_one_cp_rank(oracle):
    """CP rank r of C holds every page and exports pages i with i % C == r only."""
    model_dir, prompt, _, cp1_pages = oracle
    for cp in (2, 4):
        union = torch.zeros_like(cp1_pages)
        for cp_rank in range(cp):
            parallel = ParallelConfig(cp=cp, cp_rank=cp_rank)
            rank = load_engine(
                model_dir,
                dtype="float64",
                page_size=PAGE,
                batch_invariant_attention=True,
                parallel=parallel,
            )
            import_prefix(rank, prompt, cp1_pages)
            arena = torch.zeros_like(cp1_pages)
            export_prefix(rank, prompt, arena)
            written = [i for i in range(PAGES) if bool(arena[i].any())]
            assert written == [i for i in range(PAGES) if i % cp == cp_rank]
            union[written] = arena[written]
        assert torch.equal(union, cp1_pages)


def test_a_cp_rank_without_its_group_says_so(oracle):
    model_dir, prompt, _, _ = oracle
    alone = load_engine(
        model_dir,
        dtype="float64",
        page_size=PAGE,
        batch_invariant_attention=True,
        parallel=ParallelConfig(cp=2),
    )
    with pytest.raises(RuntimeError, match="needs a group of that many CP ranks"):
        alone.generate([Request(prompt, SamplingParams(2))])
    assert alone.pool.free_pages == alone.pool.num_pages


@pytest.mark.parametrize(
    ("tp", "pp", "cp"),
    [
        (1, 1, 4),
        (2, 1, 2),
        (1, 2, 2),
        # 8 ranks: the one test of CP=4 with TP.
        pytest.param(2, 1, 4, marks=pytest.mark.slow),
    ],
)
def test_cp_with_tp_and_pp_matches_hf_and_reads_cp2_pages(oracle, cp2_pages, tp, pp, cp):
    model_dir, prompt, hf, cp1_pages = oracle
    with ParallelEngine(model_dir, tp=tp, pp=pp, cp=cp, **BYTE_EXACT_GROUP) as group:
        pages = run_group(group, prompt, hf)
        group.clear_cache()
        assert group.import_prefix(prompt, cp2_pages) == PAGES
        generate_from_pages(group, prompt, hf)
    if tp == 1:  # PP splits layers, not sums: CP=1's bytes
        assert_pages_equal(pages, cp1_pages)
        return
    # TP's all-reduce sums partial products in another order than TP=1: equal
    # to rounding across TP, byte for byte against the same TP at CP=1.
    torch.testing.assert_close(pages.view(torch.float64), cp1_pages.view(torch.float64),
                               rtol=0, atol=1e-12)  # fmt: skip
    with ParallelEngine(model_dir, tp=tp, pp=pp, **BYTE_EXACT_GROUP) as same_tp:
        same_tp.generate([Request(prompt, SamplingParams(1))])
        assert_pages_equal(pages, same_tp.export_prefix(prompt))
