"""The worker side of `KvrelayConnector`: fills blocks from the tier before a
step's forward and writes the step's new full blocks after it.

Pages move whole (every layer of the rank's heads at once) through staging
rows of unified pages, so `save_kv_layer` and `wait_for_layer_load` have
nothing to do per layer: the blocks a step loads are filled before its
forward starts, and the blocks it completes are written once its forward
has written every layer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import torch

from kvrelay.adapters.vllm.blocks import BlockPages, probe_permutation
from kvrelay.adapters.vllm.handoff import (
    HandoffPuller,
    HandoffService,
    HoldBook,
    KvMemory,
    layout_fingerprint,
)
from kvrelay.adapters.vllm.latent_blocks import latent_block_view, latent_permutation
from kvrelay.adapters.vllm.scheduler import PageBatch, Pull, StepPlan
from kvrelay.adapters.vllm.tier import RankTier, TierLoop
from kvrelay.layout import ModelKVSpec, Rectangle

log = logging.getLogger("kvrelay.adapters.vllm")

# A file each P/D pull appends {"request_id", "seconds", "bytes"} to (benches).
TRANSFER_LOG = os.environ.get("KVRELAY_VLLM_TRANSFER_LOG", "")


def cpu_cache_writer(dtype: torch.dtype, block_size: int, head_dim: int):
    """vLLM's CPU attention cache write (`cpu_attn_reshape_and_cache`) for one layer."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)

    def write(key, value, cache, slot_mapping) -> None:
        blocks, heads, size, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, size * 2, head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)

    return write


def flash_cache_writer(dtype: torch.dtype, block_size: int, head_dim: int):
    """vLLM's GPU cache write (`reshape_and_cache_flash`) for one layer, on the
    K and V views its attention backends take of a [blocks, heads, block,
    2*head_dim] cache."""
    from vllm import _custom_ops as ops

    def write(key, value, cache, slot_mapping) -> None:
        key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
        scale = torch.ones(1, dtype=torch.float32, device=cache.device)
        ops.reshape_and_cache_flash(
            key, value, key_cache, value_cache, slot_mapping, "auto", scale, scale
        )

    return write


def layer_order(names) -> list[str]:
    """vLLM's attention layer names in model order."""
    from vllm.model_executor.models.utils import extract_layer_index

    return sorted(names, key=extract_layer_index)


class WorkerSide:
    def __init__(self, spec: ModelKVSpec, rect: Rectangle, tier_config, rank: int = 0) -> None:
        self.spec, self.rect, self.rank = spec, rect, rank
        self.timeout_s = tier_config.timeout_s
        self.tier_config = tier_config
        self.pages: BlockPages | None = None
        self.loop: TierLoop | None = None
        self.tier: RankTier | None = None
        self.holds = HoldBook()
        self.service: HandoffService | None = None
        self.puller: HandoffPuller | None = None
        # Asynchronous loads end on the tier loop's thread; vLLM asks from its own.
        self.lock = threading.Lock()
        self.load_errors: set[int] = set()
        self.loaded: set[str] = set()
        self.counters = {"loaded_pages": 0, "missed_pages": 0, "written_pages": 0, "errors": 0,
                         "pulled_blocks": 0, "pull_errors": 0, "handed_off": 0}  # fmt: skip

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        caches = [kv_caches[name] for name in layer_order(kv_caches)]
        if len(caches) != self.spec.num_layers:
            raise ValueError(f"{len(caches)} layer caches for a {self.spec.num_layers}-layer model")
        latent = self.spec.attention_kind == "mla"
        if latent:  # one latent head per block: MLA blocks move as one-head blocks
            caches = [latent_block_view(c) for c in caches]
        first = caches[0]
        if first.device.type not in ("cpu", "cuda") or first.dim() != 4:
            raise ValueError(
                "KvrelayConnector moves vLLM's attention caches [blocks, heads, block, "
                f"2*head_dim] on CPU or CUDA; got {tuple(first.shape)} on {first.device}"
            )
        _, heads, block_size, fused = first.shape
        if heads != self.rect.num_heads or block_size != self.spec.page_size:
            raise ValueError(
                f"cache of {heads} heads x {block_size} tokens; the rank owns "
                f"{self.rect.num_heads} heads of {self.spec.page_size}-token pages"
            )
        if first.device.type == "cpu" and hasattr(torch.cpu, "_init_amx"):
            # A first attention call of one query token on an AMX CPU dies of
            # an illegal instruction unless the tile state is set up first; a
            # load that leaves only a prompt's last token to compute makes it.
            torch.cpu._init_amx()
        if latent:
            if fused != self.spec.k_head_dim:
                raise ValueError(f"latent rows of {fused}; the pages hold {self.spec.k_head_dim}")
            perm = latent_permutation(block_size, fused, self.spec.rope_head_dim,
                                      self.tier_config.mla_rope_interleave)  # fmt: skip
        else:
            perm = self._probe(first)
        self.pages = BlockPages(caches, perm, self.spec.num_kv_heads, self.rect.head_start)
        self.loop = TierLoop("kvrelay-vllm-worker")
        self.tier = self.loop.run(
            RankTier(self.tier_config, self.spec, self.rect).start(staging=True), 30
        )
        self._start_handoff(caches, layout_fingerprint(perm, first))

    @staticmethod
    def _probe(first: torch.Tensor) -> torch.Tensor:
        """An MHA block's tiling, asked of the engine's own cache write."""
        _, heads, block_size, fused = first.shape
        if first.device.type == "cpu":
            write = cpu_cache_writer(first.dtype, block_size, fused // 2)
        else:
            write = flash_cache_writer(first.dtype, block_size, fused // 2)
        return probe_permutation(write, heads, block_size, fused // 2, first.dtype, first.device)

    def _start_handoff(self, caches, layout: str) -> None:
        """Registers vLLM's KV memory with the agent: a prefill serves its held
        blocks from it, a decode pulls into it."""
        c, agent = self.tier_config, self.tier.agent
        memory = KvMemory(agent, caches, layout, c.huge_pages)
        log.info("kvrelay: vLLM's KV cache registered, %d MiB of it on huge pages",
                 memory.huge_page_bytes >> 20)  # fmt: skip
        namespace = self.spec.namespace()
        self.puller = HandoffPuller(agent, memory, namespace, c.token, c.timeout_s)
        if c.handoff_port:
            service = HandoffService(agent, memory, self.holds, namespace, c.token)
            port = c.handoff_port + self.rank
            self.service = self.loop.run(service.start(c.handoff_host, port), 30)

    def close(self) -> None:
        if self.loop is not None:
            try:
                if self.service is not None:
                    self.loop.run(self.service.close(), 10)
                if self.puller is not None:
                    self.loop.run(self.puller.close(), 10)
                self.loop.run(self.tier.close(), 10)
            finally:
                self.loop.close()

    def load(self, plan: StepPlan) -> None:
        for held in plan.holds:
            self.holds.add(held.req_id, held.block_ids, held.deadline)
        bound = self.timeout_s + 5  # each transfer bounds itself by timeout_s
        for pull in plan.pulls:
            self.loop.run(self._pull(pull), bound)
        for batch in plan.loads:
            self.loop.run(self._read(batch), bound)
        started: dict[str, list] = {}
        for item in [*plan.async_pulls, *plan.async_loads]:
            started.setdefault(item.req_id, []).append(item)
        for req_id, items in started.items():
            self.loop.submit(self._load_async(req_id, items))

    async def _load_async(self, req_id: str, items: list) -> None:
        """One parked request's pulls and loads, then its report in `get_finished`
        (its failed blocks recorded first, so vLLM sees them by then)."""
        started = time.perf_counter()
        for item in items:
            await (self._pull(item) if isinstance(item, Pull) else self._read(item))
        with self.lock:
            self.loaded.add(req_id)
        if TRANSFER_LOG:
            with open(TRANSFER_LOG, "a") as log_file:
                record = {"request_id": req_id, "async": True,
                          "seconds": time.perf_counter() - started}  # fmt: skip
                log_file.write(json.dumps(record) + "\n")

    def finished_loading(self) -> set[str]:
        """Requests whose asynchronous loads ended (with or without errors)."""
        with self.lock:
            done, self.loaded = self.loaded, set()
        return done

    def _failed(self, block_ids) -> None:
        with self.lock:
            self.load_errors.update(block_ids)

    async def _read(self, batch: PageBatch) -> None:
        def consume(rows, start: int, n: int) -> None:
            self.pages.scatter(rows, batch.block_ids[start : start + n])

        try:
            read = self.tier.read(batch.keys, consume)
            found = await asyncio.wait_for(read, self.timeout_s)
        except Exception as exc:  # a failed load is recomputed by vLLM
            self.counters["errors"] += 1
            log.warning("kvrelay: loading %d pages failed (%s); vLLM recomputes them",
                        len(batch.keys), exc)  # fmt: skip
            found = 0
        self.counters["loaded_pages"] += found
        if found < len(batch.keys):
            self.counters["missed_pages"] += len(batch.keys) - found
            self._failed(batch.block_ids[found:])

    async def _pull(self, pull: Pull) -> None:
        """A finished prefill's blocks into this request's blocks; on any failure
        the blocks are reported and vLLM recomputes them."""
        started = time.perf_counter()
        try:
            if len(pull.agents) <= self.rank:
                raise ValueError(f"a prefill of {len(pull.agents)} ranks; this is rank {self.rank}")
            coro = self.puller.pull(
                pull.agents[self.rank], pull.remote_req_id, pull.remote_block_ids, pull.block_ids
            )
            moved = await asyncio.wait_for(coro, self.timeout_s)
        except Exception as exc:
            self.counters["pull_errors"] += 1
            self._failed(pull.block_ids)
            log.warning("kvrelay: pulling %d blocks of %s failed (%s); vLLM recomputes them",
                        len(pull.block_ids), pull.remote_req_id, exc)  # fmt: skip
            return
        seconds = time.perf_counter() - started
        self.counters["pulled_blocks"] += len(pull.block_ids)
        if TRANSFER_LOG:  # benches read each pull's time from here
            with open(TRANSFER_LOG, "a") as log_file:
                record = {"request_id": pull.req_id, "seconds": seconds,
                          "computed_tokens": pull.computed_tokens} | moved  # fmt: skip
                log_file.write(json.dumps(record) + "\n")

    def finished_sending(self) -> set[str]:
        """Held prefills whose decode released them, or whose hold ran out."""
        if self.service is None:
            return set()
        leases = self.tier.agent.leases
        done = self.holds.take_finished(lambda lease_id: leases.get(lease_id) is not None)
        self.counters["handed_off"] += len(done)
        return done

    def save(self, plan: StepPlan) -> None:
        for batch in plan.saves:

            def produce(rows, start: int, n: int, batch=batch) -> None:
                self.pages.gather(batch.block_ids[start : start + n], rows)

            try:
                written = self.loop.run(self.tier.write(batch.keys, produce), self.timeout_s)
                self.counters["written_pages"] += written
            except Exception as exc:  # a page not written is a later miss
                self.counters["errors"] += 1
                log.warning("kvrelay: writing %d pages failed (%s)", len(batch.keys), exc)

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errors, self.load_errors = self.load_errors, set()
        return errors
