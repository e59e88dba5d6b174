"""The scheduler side of `KvrelayConnector`: how much of a prompt the tier
holds, which blocks to fill from it, and which new full blocks to write.

A page is one vLLM block. A request's hit is the tier's leading run of
sealed pages of its prompt, never its last token (whose logits vLLM must
compute). Loads are synchronous (the worker fills the blocks before the
step's forward), so the hit is plain prefill the engine skips; pages that
fail to load are reported by the worker and recomputed by vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.layout import ModelKVSpec, Rectangle


@dataclass(slots=True)
class PageBatch:
    """Pages of one request to move: keys and the vLLM blocks that hold them."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    """What the workers do around one scheduler step (vLLM pickles it to them)."""

    loads: list[PageBatch] = field(default_factory=list)
    saves: list[PageBatch] = field(default_factory=list)


@dataclass(slots=True)
class Tracked:
    """A running request (vLLM's own object: its tokens grow as it decodes), its
    blocks, and the leading pages the tier holds."""

    request: object
    block_ids: list[int] = field(default_factory=list)
    tier_pages: int = 0  # leading pages the tier holds (found or written)
    load: tuple[int, int] | None = None  # pages [first, end) to load at its first step


class SchedulerSide:
    """`count_prefix(keys)` answers how many leading pages of `keys` the tier
    holds sealed; it raises (or times out) when the tier does not answer."""

    def __init__(self, spec: ModelKVSpec, rect: Rectangle, count_prefix) -> None:
        self.spec, self.rect = spec, rect
        self.page_size = spec.page_size
        self.count_prefix = count_prefix
        self.requests: dict[str, Tracked] = {}
        self.probes = 0
        self.probe_errors = 0

    def matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Prompt tokens beyond `num_computed_tokens` the tier can fill now."""
        tokens = list(request.prompt_token_ids or [])
        usable = (len(tokens) - 1) // self.page_size  # the last token is always computed
        tracked = self.requests.setdefault(request.request_id, Tracked(request))
        if usable * self.page_size <= num_computed_tokens:
            return 0
        keys = self.spec.page_keys(tokens[: usable * self.page_size])
        self.probes += 1
        try:
            hits = self.count_prefix(keys)
        except Exception:  # a tier that does not answer is a miss
            self.probe_errors += 1
            hits = 0
        tracked.tier_pages = hits
        first = num_computed_tokens // self.page_size
        if hits <= first:
            return 0
        tracked.load = (first, hits)
        return hits * self.page_size - num_computed_tokens

    def after_alloc(self, request, num_external_tokens: int) -> None:
        tracked = self.requests.get(request.request_id)
        if tracked is not None and num_external_tokens == 0:
            tracked.load = None

    def plan(self, scheduler_output) -> StepPlan:
        """Loads of newly scheduled requests, and writes of every page this step completes."""
        plan = StepPlan()
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self.requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            if tracked.load is not None:
                first, end = tracked.load
                tokens = list(tracked.request.prompt_token_ids)[: end * self.page_size]
                keys = self.spec.page_keys(tokens)[first:end]
                plan.loads.append(PageBatch(new.req_id, keys, tracked.block_ids[first:end]))
                tracked.load = None
            self._plan_save(plan, new.req_id, tracked, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self.requests.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            self._plan_save(plan, req_id, tracked, cached.num_computed_tokens[i], scheduler_output)
        return plan

    def _plan_save(self, plan: StepPlan, req_id: str, tracked: Tracked, computed: int, out) -> None:
        tokens = tracked.request.all_token_ids
        done = computed + out.num_scheduled_tokens.get(req_id, 0)
        full = min(done, len(tokens), len(tracked.block_ids) * self.page_size) // self.page_size
        if full <= tracked.tier_pages or not self.rect.writer:
            return
        keys = self.spec.page_keys(list(tokens[: full * self.page_size]))
        first = tracked.tier_pages
        plan.saves.append(PageBatch(req_id, keys[first:full], tracked.block_ids[first:full]))
        tracked.tier_pages = full

    def finished(self, request) -> None:
        self.requests.pop(request.request_id, None)
