"""Worker half of the connector (one per vLLM worker process, i.e. per TP/PP rank): after each layer's forward,
gather the step's sends of that layer at once and queue them on the sender, one stream per rank and transfer.

A rank's stream declares the heads and layers it holds; failures stay with the request they belong to.
"""

from __future__ import annotations

import logging
import re

import torch

from kv_bridge import wire
from kv_bridge.families import check_vllm_hf_config
from kv_bridge.fingerprint import kv_spec
from kv_bridge.send_status import StatusSink
from kv_bridge.sender import KVSender
from kv_bridge.vllm.checks import check_cache_spec, rank_heads
from kv_bridge.vllm.extract import Extractor, Span, wire_dtype_for
from kv_bridge.vllm.layers import LayerLayout, describe, layer_layouts, runtime
from kv_bridge.vllm.scheduler import DisaggConnectorMetadata, SendSpec

log = logging.getLogger("vllm.disagg.connector")
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def _tp_rank(parallel_config) -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    size = parallel_config.tensor_parallel_size
    return size, (get_tensor_model_parallel_rank() if size > 1 else 0)


class WorkerSide:
    def __init__(self, vllm_config, kv_cache_config, extra: dict, tp: tuple[int, int] | None = None):
        self._cfg, self._kv_cache_config, self._tp = vllm_config, kv_cache_config, tp
        self._sender_bytes = int(extra.get("sender_bytes", 1 << 30))
        self._timeouts = (float(extra.get("connect_timeout_s", 5.0)), float(extra.get("send_timeout_s", 10.0)))
        self._wire_option = str(extra.get("wire_dtype", "auto"))
        self._status_path = extra.get("status_socket")  # the prefill node's (kv_bridge/send_status.py)
        # The KV key (derived from the node secret by backends/prefill/node.py, never the secret itself)
        key = extra.get("kv_auth_key")
        self._kv_key = bytes.fromhex(key) if key else None
        self._frame_mac = bool(extra.get("kv_frame_mac", True))
        self.sender: KVSender | None = None
        self._extractor: Extractor | None = None
        self._layers: dict[str, object] = {}  # layer name -> vLLM attention layer (its current fp8 scales)
        self._layer_index: dict[str, int] = {}
        self._layouts: dict[str, LayerLayout] = {}  # each layer's own backend and kernel blocks (default: extractor's)
        self._heads: tuple[int, int] | None = None  # None: a replica rank, another one sends these heads
        self._window: tuple[int, tuple[int, ...]] = (0, ())
        self._streams: dict[str, wire.StreamHeader] = {}  # open streams of this rank
        self._failed: set[str] = set()  # transfers failed here: nothing more is sent for them
        self._spec: dict = {}
        self._draft_layers = 0  # the drafter's layers this engine runs after the model's (an EAGLE-3 head: 1)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cfg, mc = self._cfg, self._cfg.model_config
        check_vllm_hf_config(mc.model, mc.hf_config.to_dict())  # the engine must compute the KV mlx-lm would
        ctx = cfg.compilation_config.static_forward_context
        order, block = cfg.cache_config.get_resolved_kv_cache_layout().name, cfg.cache_config.block_size
        heads, head_dim = mc.get_num_kv_heads(cfg.parallel_config), mc.get_head_size()
        backends = {name: ctx[name].attn_backend.get_name() for name in kv_caches}  # each layer its own
        # CPU_ATTN's block interior follows the kernel ISA vLLM picked (cpu_attn.py sets layer.isa before this call)
        isas = {name: getattr(ctx[name], "isa", None) for name in kv_caches}
        layouts = layer_layouts(kv_caches, backends, order, block, heads, head_dim, isas,
                                str(cfg.cache_config.cache_dtype))
        windows, found = {}, {}
        for name in kv_caches:
            m = _LAYER_RE.search(name)
            if m is None:
                raise ValueError(f"cannot tell the layer index of attention layer {name!r}")
            found[name] = (int(m.group(1)), ctx[name])
            spec = self._spec_of(name)
            if spec is not None:
                check_cache_spec(name, spec, heads, head_dim, block)  # a drafter's layer too (see _header)
            # the layer's own window: with one KV cache group (hybrid manager off) the group's spec carries the
            # model's sliding window for full-attention layers too
            w = getattr(ctx[name], "sliding_window", None)
            if w:
                windows[found[name][0]] = int(w)
        tp_size, tp_rank = self._tp or _tp_rank(cfg.parallel_config)
        cache_dtype, first = str(cfg.cache_config.cache_dtype), next(iter(kv_caches.values()))
        wire_dtype = wire_dtype_for(first.dtype, cache_dtype, self._wire_option)
        spec = kv_spec(mc.model)
        extractor = Extractor(next(iter(layouts.values())).layout, wire_dtype, cache_dtype.startswith("fp8"),
                              first.device)
        self.configure(extractor, spec, found, rank_heads(spec["num_kv_heads"], tp_size, tp_rank),
                       _uniform_window(windows), layouts, _draft_layers(cfg))
        log.info("disagg connector: %s; attention %s (%s); cache block %d, cache %s -> wire %s, %d layers, heads %s "
                 "of %d, window %s, drafter layers %d, KV auth %s", runtime(), describe(layouts, self._layer_index),
                 order, block, cache_dtype, wire_dtype, len(kv_caches), self._heads, self._spec["num_kv_heads"],
                 self._window, self._draft_layers,
                 "off" if self._kv_key is None else "per frame" if self._frame_mac else "header only")

    def configure(self, extractor: Extractor, spec: dict, layers: dict[str, tuple[int, object]],
                  heads: tuple[int, int] | None, window: tuple[int, tuple[int, ...]] = (0, ()),
                  layouts: dict[str, LayerLayout] | None = None, draft_layers: int | None = None) -> None:
        """What register_kv_caches found (also how tests drive a rank without an engine): the extractor, the model's
        KV spec, this rank's layers (name -> (index, vLLM attention layer)), its heads (None: a replica that sends
        nothing), the sliding window, each layer's layout (default: the extractor's for all) and the drafter's layers
        after the model's in the whole engine (default: those this rank holds; every rank's header declares them)."""
        self._extractor, self._spec, self._heads, self._window = extractor, spec, heads, window
        self._layouts = layouts or {name: LayerLayout("", extractor.layout) for name in layers}
        self._layer_index = {name: i for name, (i, _) in layers.items()}
        beyond = {i for i in self._layer_index.values() if i >= spec["num_layers"]}
        self._draft_layers = len(beyond) if draft_layers is None else draft_layers
        self._layers = {name: layer for name, (_, layer) in layers.items()}
        status = StatusSink(self._status_path) if self._status_path else None  # the node hears which never opened
        self.sender = KVSender(self._sender_bytes, self._timeouts[0], self._kv_key, self._frame_mac,
                               send_timeout_s=self._timeouts[1], status=status)

    def _spec_of(self, name: str):
        for group in getattr(self._kv_cache_config, "kv_cache_groups", None) or ():
            if name in group.layer_names:
                return group.kv_cache_spec
        return None

    def _header(self, s: SendSpec) -> wire.StreamHeader:
        # a speculative_config head (vLLM's EAGLE-3 proposer) registers its layer after the model's, named
        # model.layers.<num_layers>...: its prompt KV rides the stream as one more layer (StreamHeader.draft_layers)
        layers, n = tuple(sorted(set(self._layer_index.values()))), self._spec["num_layers"]
        draft = self._draft_layers
        full = self._heads == (0, self._spec["num_kv_heads"])
        window, wl = self._window
        return wire.StreamHeader(
            transfer_id=s.transfer_id, fingerprint=self._spec["fingerprint"], num_layers=n, draft_layers=draft,
            num_kv_heads=self._spec["num_kv_heads"], head_dim=self._spec["head_dim"],
            dtype=self._extractor.wire_dtype, start=s.kv_start, num_tokens=s.total - s.kv_start,
            head_start=0 if full else self._heads[0], head_count=0 if full else self._heads[1],
            layers=None if len(layers) == n + draft else layers,
            # layer 0 travels whole even where it slides (gpt-oss): the decode node checks every position of it
            # against its own recomputation (kv_bridge/mlx/traffic.py); ~5% more bytes on gpt-oss-120b
            window=window, window_layers=tuple(x for x in wl if x in layers and x != 0) if window else ())

    def save_kv_layer(self, meta: DisaggConnectorMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        layer = self._layer_index.get(layer_name)
        if not meta.sends or self._heads is None or layer is None:  # None: not a layer this rank registered
            return
        spans, sends, ll = [], [], self._layouts[layer_name]
        for s in meta.sends:
            try:
                hdr = self._stream(s)
                if hdr is None:
                    continue
                a = max(s.start, hdr.layer_start(layer))  # a sliding layer sends only the window's tokens
                if a < s.end:
                    blocks = ll.kernel_blocks(s.block_ids)
                    ll.layout.block_span(blocks, a, s.end)  # a bad span fails its request alone
                    spans.append(Span(blocks, a, s.end))
                    sends.append((s.transfer_id, a))
            except Exception as e:  # never the engine: this request's transfer fails, decode prefills locally
                self._fail(s.transfer_id, f"cannot read layer {layer} of request {s.req_id}: {e}")
        if not spans:
            return
        try:
            batch = self._extractor.extract_batch(kv_layer, spans, self._scales(layer_name), ll.layout)
        except Exception as e:
            for tid, _ in sends:
                self._fail(tid, f"cannot extract layer {layer}: {e}")
            return
        for (tid, a), part in zip(sends, batch.parts):
            self.sender.send_layer(tid, layer, a, part.keys, part.values, part.scales, part.ready, batch.release)

    def _stream(self, s: SendSpec) -> wire.StreamHeader | None:
        hdr = self._streams.get(s.transfer_id)
        if hdr is None and s.first and s.transfer_id not in self._failed:
            hdr = self._streams[s.transfer_id] = self._header(s)
            self.sender.open(hdr, s.host, s.port)
        return hdr

    def _scales(self, layer_name: str) -> tuple[float, float]:
        """The layer's fp8 scales as vLLM keeps them now (they may be recalibrated after registration)."""
        layer = self._layers[layer_name]
        return float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0))

    def _fail(self, tid: str, msg: str) -> None:
        log.error("KV transfer %s: %s", tid, msg)
        self._failed.add(tid)
        if self._streams.pop(tid, None) is not None:
            self.sender.close(tid, error=msg)

    def wait_for_save(self, meta: DisaggConnectorMetadata) -> None:
        for s in meta.sends:
            if s.end >= s.total:
                self._failed.discard(s.transfer_id)
                if self._streams.pop(s.transfer_id, None) is not None:
                    self.sender.close(s.transfer_id)
        for tid in meta.aborts:
            self._failed.discard(tid)
            if self._streams.pop(tid, None) is not None:
                self.sender.close(tid, error="prefill request ended before its KV was complete")

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.shutdown()


def _uniform_window(windows: dict[int, int]) -> tuple[int, tuple[int, ...]]:
    """(window, sliding layers) when every sliding layer has the same window; else (0, ()): send every token."""
    if not windows or len(set(windows.values())) != 1:
        if windows:
            log.warning("sliding layers with different windows %s: sending every token of them", windows)
        return 0, ()
    return next(iter(windows.values())), tuple(sorted(windows))


def _draft_layers(cfg) -> int:
    """The layers of an EAGLE-3 head the engine runs (speculative_config): their KV follows the model's."""
    spec = getattr(cfg, "speculative_config", None)
    if spec is None or not spec.use_eagle():
        return 0
    if spec.method not in ("eagle3", "dflash"):
        raise ValueError(f"speculative_config method {spec.method!r} on a prefill node: only an EAGLE-3 head's KV is "
                         "bridged (set the model's prefill_draft_path to an EAGLE-3 head, or leave it unset)")
    return int(spec.draft_model_config.hf_config.num_hidden_layers)
