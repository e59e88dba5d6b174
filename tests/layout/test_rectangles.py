import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.layout import (
    LayoutError,
    ModelKVSpec,
    ParallelConfig,
    Rectangle,
    page_writers,
    rank_rectangle,
    stage_layers,
)
from tests.layout.strategies import kv_specs, parallel_configs


def coverage(spec: ModelKVSpec, rects) -> np.ndarray:
    """How many times each byte of a page object is covered by the rectangles' runs."""
    count = np.zeros(spec.page_bytes, dtype=np.int32)
    for rect in rects:
        for offset, length in rect.byte_runs(spec):
            count[offset : offset + length] += 1
    return count


@st.composite
def spec_and_config(draw):
    spec = draw(kv_specs())
    return spec, draw(parallel_configs(spec))


@settings(max_examples=300, deadline=None)
@given(spec_and_config(), st.integers(0, 20))
def test_writers_tile_each_page_exactly_once(case, page_index):
    spec, config = case
    writers = page_writers(spec, config, page_index)
    # One writer per (TP replica group, PP stage) on the owning CP rank.
    assert len(writers) == min(config.tp, spec.num_kv_heads) * config.pp
    assert {rank.cp_rank for rank, _ in writers} == {page_index % config.cp}
    assert (coverage(spec, [rect for _, rect in writers]) == 1).all()


@settings(max_examples=300, deadline=None)
@given(spec_and_config())
def test_every_reader_reads_inside_the_page_and_readers_cover_it(case):
    spec, config = case
    replicas = max(1, config.tp // spec.num_kv_heads)
    for cp_rank in range(config.cp):
        readers = [
            rank_rectangle(spec, rank) for rank in config.all_ranks() if rank.cp_rank == cp_rank
        ]
        for rect in readers:
            runs = rect.byte_runs(spec)
            assert all(off >= 0 and off + length <= spec.page_bytes for off, length in runs)
            assert sum(length for _, length in runs) == rect.num_bytes(spec)
            # Runs are sorted, disjoint and merged where they touch.
            for (a, alen), (b, _) in itertools.pairwise(runs):
                assert a + alen < b
        # Every replica reads: each byte is read by exactly `replicas` ranks.
        assert (coverage(spec, readers) == replicas).all()


@settings(max_examples=200, deadline=None)
@given(spec_and_config())
def test_stages_partition_the_layers_in_order(case):
    spec, config = case
    bounds = [stage_layers(spec, config.with_rank(pp_rank=s)) for s in range(config.pp)]
    assert bounds[0][0] == 0 and bounds[-1][1] == spec.num_layers
    for (_, end), (start, _) in itertools.pairwise(bounds):
        assert end == start
    assert all(start < end for start, end in bounds)


def spec(**overrides) -> ModelKVSpec:
    fields = dict(
        model_id="m",
        weights_fingerprint="w",
        num_layers=4,
        num_kv_heads=8,
        k_head_dim=128,
        v_head_dim=128,
        kv_dtype="bfloat16",
        page_size=64,
    )
    fields.update(overrides)
    return ModelKVSpec(**fields)


def test_tp_only_rank_is_one_contiguous_run():
    s = spec()
    rect = rank_rectangle(s, ParallelConfig(tp=4, tp_rank=1))
    assert (rect.head_start, rect.head_end, rect.layer_start, rect.layer_end) == (2, 4, 0, 4)
    assert rect.byte_runs(s) == [(2 * 4 * s.block_bytes, 2 * 4 * s.block_bytes)]


def test_tp_pp_rank_has_one_run_per_head():
    s = spec()
    rect = rank_rectangle(s, ParallelConfig(tp=2, pp=2, tp_rank=1, pp_rank=1))
    assert (rect.head_start, rect.head_end, rect.layer_start, rect.layer_end) == (4, 8, 2, 4)
    runs = rect.byte_runs(s)
    assert runs == [((h * 4 + 2) * s.block_bytes, 2 * s.block_bytes) for h in range(4, 8)]


def test_tp_above_heads_replicates_with_one_writer():
    s = spec(num_kv_heads=2)
    config = ParallelConfig(tp=8)
    rects = [rank_rectangle(s, r) for r in config.all_ranks()]
    assert [r.head_start for r in rects] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r.writer for r in rects] == [True, False, False, False] * 2


def test_mla_page_has_one_head_and_no_v():
    s = spec(num_kv_heads=1, k_head_dim=576, v_head_dim=0, attention_kind="mla")
    assert s.block_bytes == 64 * 576 * 2
    rects = [rank_rectangle(s, r) for r in ParallelConfig(tp=4).all_ranks()]
    assert all((r.head_start, r.head_end) == (0, 1) for r in rects)
    assert [r.writer for r in rects] == [True, False, False, False]


def test_cp_ranks_own_pages_round_robin():
    s = spec()
    config = ParallelConfig(cp=3)
    owners = [[r.cp_rank for r, _ in page_writers(s, config, i)] for i in range(6)]
    assert owners == [[0], [1], [2], [0], [1], [2]]


def test_explicit_pp_split():
    s = spec(num_layers=10)
    config = ParallelConfig(pp=3, pp_layer_split=(2, 5, 3))
    assert [stage_layers(s, config.with_rank(pp_rank=i)) for i in range(3)] == [
        (0, 2),
        (2, 7),
        (7, 10),
    ]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ParallelConfig(tp=3), "does not divide"),
        (ParallelConfig(tp=12), "multiple"),
        (ParallelConfig(pp=5), "exceeds"),
        (ParallelConfig(pp=2, pp_layer_split=(1, 2)), "does not sum"),
    ],
)
def test_configs_that_cannot_run_the_model_are_rejected(config, message):
    with pytest.raises(LayoutError, match=message):
        rank_rectangle(spec(), config)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tp=0),
        dict(tp=2, tp_rank=2),
        dict(pp=2, pp_rank=-1),
        dict(cp=2, cp_rank=5),
        dict(pp=2, pp_layer_split=(3,)),
        dict(pp=2, pp_layer_split=(3, 0)),
    ],
)
def test_bad_parallel_configs_are_rejected(kwargs):
    with pytest.raises(LayoutError):
        ParallelConfig(**kwargs)


def test_rectangle_outside_the_page_is_rejected():
    with pytest.raises(LayoutError, match="exceeds"):
        Rectangle(0, 9, 0, 4).byte_runs(spec())
    with pytest.raises(LayoutError):
        Rectangle(2, 2, 0, 1)
