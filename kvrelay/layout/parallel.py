"""Parallel configurations and the rectangle of a page each rank owns.

A rank owns heads [h0, h1) x layers [l0, l1) of every page it holds:

* TP splits KV heads evenly. When TP > heads, each head is replicated over
  TP / heads consecutive ranks (MLA's single latent head over all of them);
  every replica reads it, only the first replica of a group writes it.
* PP splits layers into contiguous stages (evenly, the first `L % pp` stages
  taking one extra layer, unless an explicit `pp_layer_split` is given).
* CP splits sequences at page boundaries: page i belongs to CP rank i % cp
  (round robin keeps causal attention work balanced as a sequence grows).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from kvrelay.layout.spec import LayoutError, ModelKVSpec


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Sizes of a TP x PP x CP group and one rank's coordinates in it."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    pp_layer_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for size, rank in (("tp", "tp_rank"), ("pp", "pp_rank"), ("cp", "cp_rank")):
            n, r = getattr(self, size), getattr(self, rank)
            if not isinstance(n, int) or n <= 0:
                raise LayoutError(f"{size} must be a positive int, got {n!r}")
            if not isinstance(r, int) or not 0 <= r < n:
                raise LayoutError(f"{rank} must lie in [0, {n}), got {r!r}")
        split = self.pp_layer_split
        if split is not None:
            if len(split) != self.pp or any(int(n) <= 0 for n in split):
                raise LayoutError(f"pp_layer_split needs {self.pp} positive layer counts")
            object.__setattr__(self, "pp_layer_split", tuple(int(n) for n in split))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def rank(self) -> int:
        """Global rank: TP fastest, then PP, then CP."""
        return (self.cp_rank * self.pp + self.pp_rank) * self.tp + self.tp_rank

    def with_rank(self, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0) -> ParallelConfig:
        return replace(self, tp_rank=tp_rank, pp_rank=pp_rank, cp_rank=cp_rank)

    def all_ranks(self) -> Iterator[ParallelConfig]:
        """Every rank of this group, in global rank order."""
        for cp_rank in range(self.cp):
            for pp_rank in range(self.pp):
                for tp_rank in range(self.tp):
                    yield self.with_rank(tp_rank, pp_rank, cp_rank)

    def validate_for(self, spec: ModelKVSpec) -> None:
        """Raise LayoutError unless this config can run `spec`."""
        heads = spec.num_kv_heads
        if self.tp <= heads:
            if heads % self.tp:
                raise LayoutError(f"tp={self.tp} does not divide {heads} KV heads")
        elif self.tp % heads:
            raise LayoutError(f"tp={self.tp} > {heads} KV heads must be a multiple of them")
        if self.pp_layer_split is None:
            if self.pp > spec.num_layers:
                raise LayoutError(f"pp={self.pp} exceeds {spec.num_layers} layers")
        elif sum(self.pp_layer_split) != spec.num_layers:
            raise LayoutError(
                f"pp_layer_split {self.pp_layer_split} does not sum to {spec.num_layers} layers"
            )

    def owns_page(self, page_index: int) -> bool:
        """Whether this rank's CP shard holds page `page_index` of a sequence."""
        return page_index % self.cp == self.cp_rank


@dataclass(frozen=True, slots=True)
class Rectangle:
    """Heads [head_start, head_end) x layers [layer_start, layer_end) of a page."""

    head_start: int
    head_end: int
    layer_start: int
    layer_end: int
    writer: bool = True

    def __post_init__(self) -> None:
        if not (0 <= self.head_start < self.head_end and 0 <= self.layer_start < self.layer_end):
            raise LayoutError(f"empty or negative rectangle {self}")

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def check_inside(self, spec: ModelKVSpec) -> None:
        if self.head_end > spec.num_kv_heads or self.layer_end > spec.num_layers:
            raise LayoutError(
                f"rectangle {self} exceeds a page of {spec.num_kv_heads} heads "
                f"x {spec.num_layers} layers"
            )

    def byte_runs(self, spec: ModelKVSpec) -> list[tuple[int, int]]:
        """(offset, length) byte runs of this rectangle inside a page object.

        One run per head, merged where they touch: a rectangle spanning all
        layers is a single run, whatever its heads.
        """
        self.check_inside(spec)
        first = spec.layer_offset(self.layer_start)
        length = spec.layer_offset(self.layer_end) - first
        runs: list[tuple[int, int]] = []
        for head in range(self.head_start, self.head_end):
            offset = head * spec.head_bytes + first
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((offset, length))
        return runs

    def num_bytes(self, spec: ModelKVSpec) -> int:
        layers = spec.layer_offset(self.layer_end) - spec.layer_offset(self.layer_start)
        return self.num_heads * layers


def stage_layers(spec: ModelKVSpec, parallel: ParallelConfig) -> tuple[int, int]:
    """[start, end) of the layers held by `parallel`'s PP stage."""
    parallel.validate_for(spec)
    if parallel.pp_layer_split is not None:
        counts = parallel.pp_layer_split
    else:
        base, extra = divmod(spec.num_layers, parallel.pp)
        counts = tuple(base + (1 if stage < extra else 0) for stage in range(parallel.pp))
    start = sum(counts[: parallel.pp_rank])
    return start, start + counts[parallel.pp_rank]


def rank_rectangle(spec: ModelKVSpec, parallel: ParallelConfig) -> Rectangle:
    """The rectangle `parallel`'s rank reads; `writer` says whether it also writes it."""
    parallel.validate_for(spec)
    heads = spec.num_kv_heads
    if parallel.tp <= heads:
        per_rank = heads // parallel.tp
        head_start, head_end = parallel.tp_rank * per_rank, (parallel.tp_rank + 1) * per_rank
        writer = True
    else:
        replicas = parallel.tp // heads
        head_start = parallel.tp_rank // replicas
        head_end = head_start + 1
        writer = parallel.tp_rank % replicas == 0
    layer_start, layer_end = stage_layers(spec, parallel)
    return Rectangle(head_start, head_end, layer_start, layer_end, writer)


def page_writers(
    spec: ModelKVSpec, parallel: ParallelConfig, page_index: int
) -> list[tuple[ParallelConfig, Rectangle]]:
    """The ranks of `parallel`'s group that write page `page_index`, with their rectangles."""
    writers = []
    for rank in parallel.all_ranks():
        if rank.owns_page(page_index):
            rect = rank_rectangle(spec, rank)
            if rect.writer:
                writers.append((rank, rect))
    return writers
