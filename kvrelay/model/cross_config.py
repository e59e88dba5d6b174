"""Running one model under a parallel config, and carrying a prefix's pages
from one config to another (`kvrelay generate --prefix-parallel`).

A prefix computed under tp=T,pp=P,cp=C is exported as unified pages and
imported by the run's own config; the run then computes only what follows.
Since pages carry no parallel information, the output must equal a plain run.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch

from kvrelay.layout import LayoutError, ParallelConfig
from kvrelay.model.engine import Request, Result
from kvrelay.model.sampling import SamplingParams

_SIZES = ("tp", "pp", "cp")


def parse_parallel(text: str) -> ParallelConfig:
    """'tp=2,pp=1,cp=2' (any subset, default 1) -> ParallelConfig sizes."""
    sizes = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in _SIZES or name in sizes or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"expected tp=T,pp=P,cp=C (positive integers, each once), got {text!r}"
            )
        sizes[name] = int(value)
    try:
        return ParallelConfig(**sizes)
    except LayoutError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


class Runner:
    """One engine (in process) or a `ParallelEngine`, behind one interface."""

    def __init__(self, engine, group) -> None:
        self.engine, self.group = engine, group

    def generate(self, requests: list[Request]) -> list[Result]:
        return (self.group or self.engine).generate(requests)

    def export_prefix(self, tokens: list[int]) -> torch.Tensor:
        if self.group is not None:
            return self.group.export_prefix(tokens)
        from kvrelay.model.page_export import export_prefix

        pages = -(-len(tokens) // self.engine.spec.page_size)
        arena = torch.zeros(pages, self.engine.spec.page_bytes, dtype=torch.uint8)
        export_prefix(self.engine, tokens, arena)
        return arena

    def import_prefix(self, tokens: list[int], arena: torch.Tensor) -> int:
        if self.group is not None:
            return self.group.import_prefix(tokens, arena)
        from kvrelay.model.page_export import import_prefix

        return import_prefix(self.engine, tokens, arena)

    # Draft (MTP) pages, with speculation on (`kvrelay.model.draft_transfer`).
    def export_draft_prefix(self, tokens: list[int]) -> torch.Tensor | None:
        from kvrelay.model.draft_transfer import export_draft_prefix

        engine = self.engine
        if self.group is None and engine.draft is None:
            return None
        if self.group is not None:
            return self.group.export_draft_prefix(tokens)
        pages = max(0, (len(tokens) - 1) // engine.spec.page_size)
        arena = torch.zeros(pages, engine.draft.spec.page_bytes, dtype=torch.uint8)
        export_draft_prefix(engine, tokens, arena)
        return arena

    def import_draft_prefix(self, tokens: list[int], arena: torch.Tensor) -> int:
        if self.group is not None:
            return self.group.import_draft_prefix(tokens, arena)
        from kvrelay.model.draft_transfer import import_draft_prefix

        return import_draft_prefix(self.engine, tokens, arena)


@contextmanager
def open_runner(model_dir, sizes: ParallelConfig, **options):
    """A runner for `sizes` (tp x pp x cp ranks); `options`: dtype, page_size,
    num_pages."""
    if sizes.world_size == 1:
        from kvrelay.model.loader import load_engine

        yield Runner(load_engine(model_dir, **options), None)
        return
    from kvrelay.model.parallel import ParallelEngine

    with ParallelEngine(model_dir, tp=sizes.tp, pp=sizes.pp, cp=sizes.cp, **options) as group:
        yield Runner(None, group)


def prefix_unified_pages(model_dir, sizes: ParallelConfig, prefix: list[int], **options):
    """(target pages, draft pages or None) of `prefix` computed under `sizes`.
    Draft pages come with `speculative` in `options` (under CP each draft
    page is written by its owner CP rank, like the target's)."""
    with open_runner(model_dir, sizes, **options) as runner:
        runner.generate([Request(prefix, SamplingParams(1))])
        draft = runner.export_draft_prefix(prefix) if options.get("speculative") else None
        return runner.export_prefix(prefix), draft
