"""vLLM KV-connector plugin (producer): streams each prefilled layer's KV to the decode node that asked for it.

Loaded by vLLM through `kv_connector_module_path="kv_bridge.vllm.connector"`, `kv_connector="DisaggConnector"`.
A request opts in with `SamplingParams(extra_args={"kv_transfer_params": {"transfer_id", "host", "port"}})`,
plus `"start": P` when the decode node already holds the KV of the first P tokens: only [P, total) is sent.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kv_bridge import wire
from kv_bridge.vllm.extract import Extractor, wire_dtype_for
from kv_bridge.families import check_vllm_hf_config
from kv_bridge.fingerprint import kv_spec
from kv_bridge.vllm.layouts import layout_for
from kv_bridge.sender import KVSender

# under vLLM's logger namespace, so our lines reach vLLM's handlers inside its worker processes
log = logging.getLogger("vllm.disagg.connector")
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class SendSpec:
    """One request's token range [start, end) read in this step, to go to (host, port); the stream covers
    [kv_start, total) and opens with the first step that sends (`first`)."""

    req_id: str
    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    start: int
    end: int
    total: int
    first: bool
    kv_start: int = 0


@dataclass
class DisaggConnectorMetadata(KVConnectorMetadata):
    sends: list[SendSpec] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # transfer ids of requests that ended before their KV did


@dataclass
class _ReqState:
    params: dict
    block_ids: list[int]
    total: int
    start: int = 0  # tokens below this are not sent: the decode node already holds their KV
    opened: bool = False  # a step has sent (and so opened the stream)


def transfer_params(extra_args: dict | None) -> dict | None:
    p = (extra_args or {}).get("kv_transfer_params")
    if isinstance(p, dict) and {"transfer_id", "host", "port"} <= p.keys():
        return p
    return None


def send_start(params: dict, total: int) -> int | None:
    """The first token to send, from kv_transfer_params["start"] (default 0); None unless it lies in [0, total)."""
    start = params.get("start", 0)
    return start if isinstance(start, int) and 0 <= start < total else None


class DisaggConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._queue_frames = int(extra.get("queue_frames", 256))
        self._connect_timeout = float(extra.get("connect_timeout_s", 5.0))
        self._wire_option = str(extra.get("wire_dtype", "auto"))
        # The KV key (derived from the node secret by backends/prefill_node.py, never the secret itself)
        key = extra.get("kv_auth_key")
        self._kv_key = bytes.fromhex(key) if key else None
        self._frame_mac = bool(extra.get("kv_frame_mac", True))
        self._reqs: dict[str, _ReqState] = {}  # scheduler side
        self._aborts: list[str] = []
        self._sender: KVSender | None = None  # worker side, created with the caches
        self._extractor: Extractor | None = None
        self._scales: dict[str, tuple[float, float]] = {}
        self._layer_index: dict[str, int] = {}
        self._open_ids: set[str] = set()
        self._spec: dict = {}

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cfg, mc = self._vllm_config, self._vllm_config.model_config
        check_vllm_hf_config(mc.model, mc.hf_config.to_dict())  # the engine must compute the KV mlx-lm would
        first_name, first = next(iter(kv_caches.items()))
        ctx = cfg.compilation_config.static_forward_context
        backend = ctx[first_name].attn_backend.get_name()
        order = cfg.cache_config.get_resolved_kv_cache_layout().name
        layout = layout_for(backend, cfg.cache_config.block_size, mc.get_num_kv_heads(cfg.parallel_config),
                            mc.get_head_size(), order)
        layout.check(tuple(first.shape))
        cache_dtype = str(cfg.cache_config.cache_dtype)
        wire_dtype = wire_dtype_for(first.dtype, cache_dtype, self._wire_option)
        self._extractor = Extractor(layout, wire_dtype, cache_dtype.startswith("fp8"), first.device)
        for name in kv_caches:
            m = _LAYER_RE.search(name)
            if m is None:
                raise ValueError(f"cannot tell the layer index of attention layer {name!r}")
            self._layer_index[name] = int(m.group(1))
            layer = ctx[name]
            self._scales[name] = (float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))
        self._spec = kv_spec(mc.model)
        self._sender = KVSender(self._queue_frames, self._connect_timeout, self._kv_key, self._frame_mac)
        log.info("disagg connector: %s/%s, block %d, cache %s -> wire %s, %d layers, KV auth %s", backend, order,
                 layout.block_size, cache_dtype, wire_dtype, len(kv_caches),
                 "off" if self._kv_key is None else "per frame" if self._frame_mac else "header only")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return  # producer: nothing to load (vLLM may call this after the forward, so streams open lazily)

    def _open(self, s: SendSpec) -> None:
        hdr = wire.StreamHeader(transfer_id=s.transfer_id, fingerprint=self._spec["fingerprint"],
                                num_layers=self._spec["num_layers"], num_kv_heads=self._spec["num_kv_heads"],
                                head_dim=self._spec["head_dim"], dtype=self._extractor.wire_dtype, start=s.kv_start,
                                num_tokens=s.total - s.kv_start)
        self._sender.open(hdr, s.host, s.port)
        self._open_ids.add(s.transfer_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not meta.sends:
            return
        layer = self._layer_index[layer_name]
        for s in meta.sends:
            if s.first and s.transfer_id not in self._open_ids:
                self._open(s)
            h = self._extractor.extract(kv_layer, s.block_ids, s.start, s.end, self._scales[layer_name])
            self._sender.send_layer(s.transfer_id, layer, s.start, h.keys, h.values, h.scales, h.ready)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for s in meta.sends:
            if s.end >= s.total and s.transfer_id in self._open_ids:
                self._open_ids.discard(s.transfer_id)
                self._sender.close(s.transfer_id)
        for tid in meta.aborts:
            if tid in self._open_ids:
                self._open_ids.discard(tid)
                self._sender.close(tid, error="prefill request ended before its KV was complete")

    def shutdown(self) -> None:
        if self._sender is not None:
            self._sender.shutdown()

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = DisaggConnectorMetadata(aborts=self._aborts)
        self._aborts = []
        so = scheduler_output
        for nr in so.scheduled_new_reqs:
            params = transfer_params(nr.sampling_params.extra_args if nr.sampling_params else None)
            if params is None:
                continue
            total = len(nr.prompt_token_ids or ())
            start = send_start(params, total)
            if start is None:  # the prefill node validates kv_start; never take the scheduler down over it
                log.error("request %s: kv_transfer_params start %r outside [0, %d); not streaming its KV", nr.req_id,
                          params.get("start"), total)
                continue
            st = _ReqState(params, list(nr.block_ids[0]), total, start)
            self._reqs[nr.req_id] = st
            # From kv_start even on vLLM's own prefix-cache hit (computed tokens C > 0): the block table covers
            # [0, end), so [kv_start, end) can be read whether kv_start is below or above C.
            end = min(nr.num_computed_tokens + so.num_scheduled_tokens[nr.req_id], st.total)
            self._add_send(meta, nr.req_id, st, st.start, end)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_blocks is not None:
                st.block_ids = list(new_blocks[0])
            elif new_blocks is not None:
                st.block_ids.extend(new_blocks[0])
            start = cached.num_computed_tokens[i]
            if start < st.total:  # later chunks of a chunked prefill; decode steps send nothing
                end = min(start + so.num_scheduled_tokens[rid], st.total)
                self._add_send(meta, rid, st, max(start, st.start), end)
        return meta

    def _add_send(self, meta: DisaggConnectorMetadata, rid: str, st: _ReqState, start: int, end: int) -> None:
        """Send [start, end) unless it is empty (a chunk wholly below kv_start); the first send opens the stream."""
        if start >= end:
            return
        p = st.params
        meta.sends.append(SendSpec(rid, str(p["transfer_id"]), str(p["host"]), int(p["port"]), list(st.block_ids),
                                   start, end, st.total, not st.opened, st.start))
        st.opened = True

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None and request.num_computed_tokens < st.total:
            self._aborts.append(str(st.params["transfer_id"]))
        return False, None  # KV was copied out during the forward; the blocks can be freed now
