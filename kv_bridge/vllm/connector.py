"""vLLM KV-connector plugin (producer): streams each prefilled layer's KV to the decode node that asked for it.

Loaded by vLLM through `kv_connector_module_path="kv_bridge.vllm.connector"`, `kv_connector="DisaggConnector"`.
A request opts in with `SamplingParams(extra_args={"kv_transfer_params": {"transfer_id", "host", "port"}})`,
plus `"start": P` when the decode node already holds the KV of the first P tokens: only [P, total) is sent.
vLLM builds one instance per role and process; this class delegates to the scheduler half or the worker half.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kv_bridge.vllm.checks import check_vllm_version
from kv_bridge.vllm.scheduler import DisaggConnectorMetadata, SchedulerSide, SendSpec, send_start, transfer_params
from kv_bridge.vllm.worker import WorkerSide

__all__ = ["DisaggConnector", "DisaggConnectorMetadata", "SendSpec", "send_start", "transfer_params"]


class DisaggConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        check_vllm_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.scheduler = SchedulerSide() if role == KVConnectorRole.SCHEDULER else None
        self.worker = WorkerSide(vllm_config, kv_cache_config, extra) if role == KVConnectorRole.WORKER else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """save_kv_layer runs between layers: a full CUDA graph would replay a step without it (and send nothing)."""
        return True

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return  # producer: nothing to load (vLLM may call this after the forward, so streams open lazily)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self.worker.save_kv_layer(self._get_connector_metadata(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self.worker.wait_for_save(self._get_connector_metadata())

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()
