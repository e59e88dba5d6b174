"""`KvrelayConnector`: kvrelay's cache tier as vLLM's KV connector (V1 API).

Loaded by vLLM from `kv_transfer_config`:

    KVTransferConfig(kv_connector="KvrelayConnector",
                     kv_connector_module_path="kvrelay.adapters.vllm.connector",
                     kv_role="kv_both", kv_connector_extra_config={...})

The scheduler side (`scheduler.py`) asks the tier how much of each prompt it
holds and plans loads and writes; the worker side (`worker.py`) moves pages
between vLLM's blocks and the tier. Both build the same namespace from the
engine's config (`identity.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvrelay.adapters.vllm.config import ConnectorConfig
from kvrelay.adapters.vllm.identity import engine_spec, rank_rect
from kvrelay.adapters.vllm.scheduler import HandoffSide, SchedulerSide, StepPlan
from kvrelay.adapters.vllm.tier import RankTier, TierLoop
from kvrelay.adapters.vllm.worker import WorkerSide

log = logging.getLogger("kvrelay.adapters.vllm")


class KvrelayConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvrelayConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = ConnectorConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        spec = engine_spec(config, vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._loop: TierLoop | None = None
        self._probe_tier: RankTier | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning(
                    "kvrelay: kv_load_failure_policy=%r fails a request whose pages "
                    "cannot be loaded; 'recompute' makes it a miss",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
            rect = rank_rect(spec, vllm_config, 0)
            count_prefix = None
            if config.servers:
                self._loop = TierLoop("kvrelay-vllm-scheduler")
                self._probe_tier = self._loop.run(RankTier(config, spec, rect).start(False), 30)

                def count_prefix(keys: list[bytes]) -> int:
                    return self._loop.run(self._probe_tier.count_prefix(keys), config.timeout_s)

            tp = vllm_config.parallel_config.tensor_parallel_size
            handoff = HandoffSide(config.handoff_agents(tp), config.handoff_hold_s)
            self._scheduler = SchedulerSide(spec, rect, count_prefix, handoff, config.async_loads)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            self._worker = WorkerSide(spec, rank_rect(spec, vllm_config, rank), config, rank)

    # -- worker side --------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer of a loaded block is in before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # pages are written whole in wait_for_save, once every layer is in

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker.save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished_sending() or None, self._worker.finished_loading() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._loop is not None:
            try:
                self._loop.run(self._probe_tier.close(), 10)
            finally:
                self._loop.close()

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvrelayConnectorMetadata)
        return metadata.plan

    # -- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        groups = blocks.get_block_ids() if num_external_tokens else None
        self._scheduler.after_alloc(request, num_external_tokens, groups[0] if groups else None)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KvrelayConnectorMetadata(self._scheduler.plan(scheduler_output))

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        params = self._scheduler.finished(request, block_ids)
        return params is not None, params
