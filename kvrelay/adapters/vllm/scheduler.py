"""The scheduler side of `KvrelayConnector`: how much of a prompt the tier
holds, which blocks to fill from it, and which new full blocks to write.

A page is one vLLM block. A request's hit is the tier's leading run of
sealed pages of its prompt, up to but not including its last token (whose
logits vLLM must compute; a page holding it still gives the tokens before
it). A load is synchronous (the worker fills the blocks before the
request's first forward) when the engine has nothing else to run, and
asynchronous otherwise (`async_loads`): vLLM parks the request until the
worker reports its blocks in (`get_finished`), stepping the others
meanwhile. Pages that fail to load are reported by the worker and
recomputed by vLLM.

P/D: a decode request whose `kv_transfer_params` name a finished prefill
loads every prompt token but the last from the prefill's blocks (the last,
partial block included); a finished prefill request that asked for a remote
decode keeps its blocks, named in the params it returns, until its workers
report them pulled or the hold expires (`handoff.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvrelay.adapters.vllm.handoff_params import (
    HandoffParams,
    prefill_reply,
    remote_prefill,
    wants_remote_decode,
)
from kvrelay.layout import ModelKVSpec, Rectangle

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PageBatch:
    """Pages of one request to move: keys and the vLLM blocks that hold them."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass(slots=True)
class Pull:
    """Blocks of a finished prefill to pull into this engine's blocks."""

    req_id: str
    agents: list[str]  # the prefill's handoff service per rank
    remote_req_id: str
    remote_block_ids: list[int]
    block_ids: list[int]
    computed_tokens: int = 0  # tokens the step computes for the request (for logs)


@dataclass(slots=True)
class HeldBlocks:
    """A finished prefill's blocks, kept for its decode until `deadline` (wall clock)."""

    req_id: str
    block_ids: list[int]
    deadline: float


@dataclass(slots=True)
class StepPlan:
    """What the workers do around one scheduler step (vLLM pickles it to them)."""

    loads: list[PageBatch] = field(default_factory=list)
    saves: list[PageBatch] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)
    holds: list[HeldBlocks] = field(default_factory=list)
    # started by the worker, not awaited: each request reported by get_finished
    async_loads: list[PageBatch] = field(default_factory=list)
    async_pulls: list[Pull] = field(default_factory=list)


@dataclass(slots=True)
class HandoffSide:
    """The scheduler's P/D settings: the handoff services of this engine's
    ranks (empty: it hands nothing off) and how long blocks wait for a decode."""

    agents: list[str]
    hold_s: float


@dataclass(slots=True)
class Tracked:
    """A running request (vLLM's own object: its tokens grow as it decodes), its
    blocks, and the leading pages the tier holds."""

    request: object
    block_ids: list[int] = field(default_factory=list)
    tier_pages: int = 0  # leading pages the tier holds (found or written)
    load: tuple[int, int] | None = None  # pages [first, end) to load at its first step
    pull: tuple[HandoffParams, int, int] | None = None  # a prefill's blocks [first, end)
    load_async: bool = False  # the load or pull runs while the engine steps others


class SchedulerSide:
    """`count_prefix(keys)` answers how many leading pages of `keys` the tier
    holds sealed; it raises (or times out) when the tier does not answer."""

    def __init__(
        self,
        spec: ModelKVSpec,
        rect: Rectangle,
        count_prefix,
        handoff: HandoffSide | None = None,
        async_loads: str = "auto",
    ) -> None:
        self.async_loads = async_loads
        self.async_plan = StepPlan()  # loads planned at allocation, for the next step
        self.spec, self.rect = spec, rect
        self.page_size = spec.page_size
        self.count_prefix = count_prefix  # None: no tier
        self.handoff = handoff
        self.namespace = spec.namespace()
        fields = {k: v for k, v in spec.identity_fields().items() if k != "layout_version"}
        log.info("kvrelay connector: namespace %s %s", self.namespace.hex()[:16], fields)
        self.requests: dict[str, Tracked] = {}
        self.new_holds: list[HeldBlocks] = []
        self.probes = 0
        self.probe_errors = 0

    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond `num_computed_tokens` the tier or a prefill can
        fill, and whether they load while the engine steps other requests."""
        tracked = self.requests.setdefault(request.request_id, Tracked(request))
        matched = self._matched(tracked, request, num_computed_tokens)
        others = len(self.requests) > 1  # this request is one of them
        tracked.load_async = matched > 0 and (
            self.async_loads == "always" or (self.async_loads == "auto" and others)
        )
        return matched, tracked.load_async

    def _matched(self, tracked: Tracked, request, num_computed_tokens: int) -> int:
        tokens = list(request.prompt_token_ids or [])
        handoff = remote_prefill(request.kv_transfer_params, self.namespace)
        if handoff is not None:
            return self._match_handoff(tracked, handoff, len(tokens), num_computed_tokens)
        # Full pages only; the last token is always computed (vLLM needs its
        # logits), but a page holding it still gives every token before it.
        full = len(tokens) // self.page_size
        if self.count_prefix is None or min(full * self.page_size, len(tokens) - 1) <= (
            num_computed_tokens
        ):
            return 0
        keys = self.spec.page_keys(tokens[: full * self.page_size])
        self.probes += 1
        try:
            hits = self.count_prefix(keys)
        except Exception:  # a tier that does not answer is a miss
            self.probe_errors += 1
            hits = 0
        tracked.tier_pages = hits
        first = num_computed_tokens // self.page_size
        loadable = min(hits * self.page_size, len(tokens) - 1)
        if hits <= first or loadable <= num_computed_tokens:
            return 0
        tracked.load = (first, hits)
        return loadable - num_computed_tokens

    def _match_handoff(self, tracked: Tracked, handoff: HandoffParams, prompt: int, computed: int):
        """Every prompt token but the last that the prefill computed, partial block included."""
        loadable = min(handoff.num_tokens, prompt - 1)
        first, end = computed // self.page_size, -(-loadable // self.page_size)
        if loadable <= computed or end > len(handoff.block_ids) or time.time() >= handoff.expires:
            return 0
        tracked.pull = (handoff, first, end)
        return loadable - computed

    def after_alloc(self, request, num_external_tokens: int, block_ids=None) -> None:
        """`block_ids`: the request's blocks now (vLLM's first KV cache group);
        an asynchronous load is planned with them, as vLLM parks the request
        before it is ever scheduled."""
        tracked = self.requests.get(request.request_id)
        if tracked is not None and num_external_tokens == 0:
            tracked.load = tracked.pull = None
        elif tracked is not None and tracked.load_async and block_ids is not None:
            tracked.block_ids = list(block_ids)
            self._plan_transfers(self.async_plan.async_loads, self.async_plan.async_pulls,
                                 request.request_id, tracked, 0)  # fmt: skip
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False  # pulled once; a preempted request recomputes

    def plan(self, scheduler_output) -> StepPlan:
        """Loads of newly scheduled requests, and writes of every page this step completes."""
        plan, self.async_plan = self.async_plan, StepPlan()
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self.requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            computed = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._plan_transfers(plan.loads, plan.pulls, new.req_id, tracked, computed)
            self._plan_save(plan, new.req_id, tracked, new.num_computed_tokens, scheduler_output)
        plan.holds, self.new_holds = self.new_holds, []
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

    def _plan_transfers(self, loads, pulls, req_id: str, tracked: Tracked, computed: int) -> None:
        """The request's planned load and pull into its blocks, once."""
        if tracked.load is not None:
            first, end = tracked.load
            tokens = list(tracked.request.prompt_token_ids)[: end * self.page_size]
            keys = self.spec.page_keys(tokens)[first:end]
            loads.append(PageBatch(req_id, keys, tracked.block_ids[first:end]))
            tracked.load = None
        if tracked.pull is not None:
            handoff, first, end = tracked.pull
            pulls.append(Pull(req_id, handoff.agents, handoff.request_id,
                              handoff.block_ids[first:end], tracked.block_ids[first:end],
                              computed))  # fmt: skip
            tracked.pull = None

    def _plan_save(self, plan: StepPlan, req_id: str, tracked: Tracked, computed: int, out) -> None:
        tokens = tracked.request.all_token_ids
        done = computed + out.num_scheduled_tokens.get(req_id, 0)
        full = min(done, len(tokens), len(tracked.block_ids) * self.page_size) // self.page_size
        if full <= tracked.tier_pages or not self.rect.writer or self.count_prefix is None:
            return
        keys = self.spec.page_keys(list(tokens[: full * self.page_size]))
        first = tracked.tier_pages
        plan.saves.append(PageBatch(req_id, keys[first:full], tracked.block_ids[first:full]))
        tracked.tier_pages = full

    def finished(self, request, block_ids) -> dict | None:
        """Forgets the request; a prefill for a remote decode keeps its blocks
        (the caller returns "free later") and gets the params that name them."""
        self.requests.pop(request.request_id, None)
        if self.handoff is None or not self.handoff.agents:
            return None
        if not wants_remote_decode(request.kv_transfer_params) or not request.is_finished():
            return None
        if block_ids and isinstance(block_ids[0], list | tuple):
            block_ids = block_ids[0]  # one KV cache group
        if not block_ids or str(request.status.name) not in KEPT_STATUSES:
            return None
        deadline = time.time() + self.handoff.hold_s
        self.new_holds.append(HeldBlocks(request.request_id, list(block_ids), deadline))
        return prefill_reply(HandoffParams(
            agents=self.handoff.agents, request_id=request.request_id,
            block_ids=list(block_ids), num_tokens=request.num_computed_tokens,
            namespace=self.namespace.hex(), expires=deadline,
        ))  # fmt: skip


# A prefill that ran to its end (not aborted, not refused) hands its blocks off.
KEPT_STATUSES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
