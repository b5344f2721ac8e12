"""Decode node: the aiohttp service around the MLX loop (backends/decode/engine.py) and the KV receiver.

POST /v1/generate waits for the prompt's KV from a prefill node (bounded), hands the request to its model's MLX
loop (no KV in time: the loop prefills it locally) and streams the protocol's token lines, then its done line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import replace
from typing import Callable

from aiohttp import web

from backends.common import (NodeError, bad_request, json_body, kv_identity, machine, node_app, node_token, open_paths,
                             project_version, run_app, versions)
from backends.decode.engine import Job, MLXModel
from backends.node_metrics import DecodeMetrics
from backends.decode.sampling import StopMatcher, parse_sampling
from kv_bridge.config.models import resolve_model_path
from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings
from kv_bridge.protocol import DoneLine, Fallback, Sampling, accepted_line, error_line
from kv_bridge.fingerprint import drafter_digest, drafter_layers, model_quantization, weight_precision
from kv_bridge.receiver import KVCapacityError, KVReceiver, TransferError

log = logging.getLogger(__name__)
_STOP_WAIT_S = 60.0  # longest wait for a cancelled generation to leave the MLX loop (one step or a local prefill)


class DecodeService:
    def __init__(self, settings: Settings, node: NodeConfig):
        self.settings, self.node = settings, node
        d = settings.decode
        self.models = {m.id: MLXModel(m.id, str(resolve_model_path(m)), d.kv_bits, d.kv_group_size, d.max_batch_size,
                                      d.prefix_cache_bytes, _speculative(m))
                       for m in settings.models if node.name in m.decode}
        if not self.models:
            raise NodeError(500, f"no model in config.toml lists decode node {node.name!r}; add it to a model's decode pool")
        for m in self.models.values():
            m.task_budget_s = settings.fidelity.mlx_budget_s
        for r in settings.models:  # the prefill nodes' drafter sends its layers in the model's shape: reserve them
            if r.id in self.models and r.prefill_draft_path:
                self.models[r.id].spec = {**self.models[r.id].spec, "draft_layers": _drafter_layers(r)}
        self.receiver = KVReceiver(settings.kv, settings.auth.kv_key(), settings.auth.kv_frame_mac)
        self.running = 0
        self.metrics = DecodeMetrics(self)
        self._identity: dict[str, dict] = {}  # model id -> kv_identity, once loaded
        # on_finished(model_id, tokens, cache) on the MLX thread when a batched generation ends, after the prefix
        # store has seen it (tests hook in here).
        self.on_finished: Callable[[str, list[int], list], None] | None = None

    async def start(self, app: web.Application) -> None:
        import mlx.core as mx

        # MLX keeps freed buffers for reuse up to its memory limit unless told: bound it (config check counts it)
        limit = self.settings.decode.mlx_cache_limit_bytes
        was = mx.set_cache_limit(limit)
        log.info("MLX cache limit %.2f GiB ([decode] mlx_cache_limit_bytes; MLX's was %.1f GiB)", limit / 2**30,
                 was / 2**30)
        loop = asyncio.get_running_loop()
        for m in self.models.values():
            await loop.run_in_executor(m.executor, m.load)
            m.start()
        await self.receiver.start(self.node.kv_host or self.node.host, self.node.kv_port)
        log.info("decode node %s: models %s, KV on %s:%d", self.node.name, list(self.models), self.node.host,
                 self.node.kv_port)

    async def stop(self, app: web.Application) -> None:
        await self.receiver.stop()
        for m in self.models.values():
            m.stop()

    def health(self) -> dict:
        ms = self.models.values()
        dead = [m.failure for m in ms if m.failure is not None]
        if dead:  # 503: the gateway marks this node down and sends its requests elsewhere
            raise NodeError(503, "; ".join(dead), "engine_dead")
        return {"role": "decode", "models": list(self.models), "running": self.running, "kv_port": self.node.kv_port,
                "batch_size": sum(m.batch_size for m in ms), "cache_bytes": sum(m.cache_bytes for m in ms),
                "transfers": len(self.receiver.transfers),  # registered and not yet settled: 0 when idle
                "prefix_cache_bytes": sum(m.prefixes.nbytes for m in ms),
                "fingerprint": {mid: m.spec["fingerprint"] for mid, m in self.models.items()},
                "quantization": {mid: model_quantization(m.path) for mid, m in self.models.items()},
                "kv_identity": {mid: self.kv_identity(m) for mid, m in self.models.items()}}

    def kv_identity(self, m: MLXModel) -> dict:
        """What shapes the KV this node builds and holds for `m` (backends/common.py), once it is loaded."""
        got = self._identity.get(m.model_id)
        if got is None:
            d = self.settings.decode
            got = kv_identity({"fingerprint": m.spec["fingerprint"], "quantization": model_quantization(m.path),
                               "weights": weight_precision(m.path), "kv_dtype": m.kv_dtype, "kv_bits": d.kv_bits,
                               "kv_group_size": d.kv_group_size if d.kv_bits else None, "machine": machine(),
                               "attention_backend": _mlx_device(), "versions": versions("mlx", "mlx-lm"),
                               "project": project_version(), "draft_head": _head_digest(m)})
            if m.kv_dtype is not None:  # loaded: it will not change until the process does
                self._identity[m.model_id] = got
        return got

    def _parse(self, body: dict) -> tuple[MLXModel, list[int], int, Sampling]:
        m = self.models.get(body.get("model"))
        if m is None:
            raise NodeError(404, f"model {body.get('model')!r} is not served by decode node {self.node.name}",
                            "model_not_found")
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise bad_request("token_ids must be a non-empty list of non-negative integers")
        kv = body.get("kv")
        kv_tokens = 0
        if kv is not None:
            kv_tokens = kv.get("tokens") if isinstance(kv, dict) else None
            if not isinstance(kv_tokens, int) or not 1 <= kv_tokens < len(ids):
                raise bad_request("kv.tokens must be an integer in [1, len(token_ids) - 1]: decode runs the last token")
        return m, ids, kv_tokens, parse_sampling(body, m.vocab_size)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        m, ids, kv_tokens, gen = self._parse(body)
        if m.failure is not None:
            raise NodeError(503, m.failure, "engine_dead")
        # Compiling a grammar takes milliseconds (cached after): off the event loop; a bad schema is a 400 here.
        grammar = await asyncio.get_running_loop().run_in_executor(None, m.grammar_for, gen, ids)
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        if rid in self.receiver.transfers:
            raise NodeError(409, f"request_id {rid!r} is already in flight on this node", "duplicate_request")
        # The decode node always runs the last prompt token itself, so a prefix covers at most len(ids) - 1.
        prefix = m.prefixes.match(m.model_id, ids, kv_tokens or len(ids) - 1)
        p = prefix.tokens if prefix is not None else 0
        try:
            transfer = self.receiver.expect(rid, kv_tokens, m.spec, p, m.kv_dtype) if kv_tokens > p else None
        except KVCapacityError as e:  # backpressure: the gateway tries another node, then answers 429
            raise NodeError(429, str(e), "kv_capacity", {"Retry-After": "1"}) from None
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        self.running += 1
        try:
            await resp.prepare(request)
            await _line(resp, accepted_line(rid, p if kv_tokens else None))
            t0 = time.perf_counter()
            kv, arrived = await self._await_kv(transfer, kv_tokens - p)
            if kv is not None and self.settings.fidelity.traffic_check:
                kv, arrived = await self._check_kv(m, ids, kv, arrived, rid)
            done = replace(arrived, prompt_tokens=len(ids), prefix_tokens=p,
                           computed_tokens=len(ids) - arrived.kv_tokens - p)
            self.metrics.finished(m.model_id, p, done.kv_tokens, done.kv_bytes, done.computed_tokens,
                                  done.fallback_reason)
            await self._stream(resp, m, self._job(m, ids, kv, gen, prefix, grammar), done, t0)
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("request %s: client went away", rid)
            raise
        finally:
            self.running -= 1
            if transfer is not None:
                self.receiver.forget(rid)
        return resp

    def _job(self, m: MLXModel, ids: list[int], kv, gen: Sampling, prefix=None, grammar=None) -> Job:
        """The MLX job for a prompt: the held prefix and the received KV after it become its initial cache, and
        only the tokens after them run. When it ends its cache goes to the prefix store."""
        start = (prefix.tokens if prefix is not None else 0) + (kv.keys.shape[2] if kv is not None else 0)
        hook = self.on_finished

        def finished(toks: list[int], cache: list) -> None:
            m.keep(toks, cache)
            if hook is not None:
                hook(m.model_id, toks, cache)
        return Job(tokens=ids[start:], gen=gen, emit=None, history=ids[:start],
                   make_cache=None if start == 0 else (lambda: m.prompt_cache(prefix, kv)),
                   on_finished=finished if m.prefixes.enabled or hook is not None else None, grammar=grammar,
                   draft_kv=None if kv is None or kv.draft_keys is None else
                   (kv.start, kv.draft_keys, kv.draft_values))  # the prefill node's head KV of the same tokens

    async def _await_kv(self, transfer, kv_tokens: int):
        """(the received KV or None, a done line carrying how it arrived or why not)."""
        none = DoneLine("length", 0, 0)
        if transfer is None:
            return None, none
        try:
            d = self.settings.decode
            kv = await transfer.result(d.kv_timeout_s, d.kv_header_timeout_s)
        except TransferError as e:
            log.warning("transfer %s: %s; prefilling locally", transfer.transfer_id, e)
            return None, replace(none, fallback_reason=e.reason)
        return kv, replace(none, kv_tokens=kv_tokens, kv_transfer_s=kv.seconds, kv_bytes=kv.nbytes,
                           kv_link_s=kv.link_s)

    async def _check_kv(self, m: MLXModel, ids: list[int], kv, arrived: DoneLine, rid: str):
        """The real-traffic check (kv_bridge/mlx/traffic.py) on the MLX thread: (kv, arrived) unchanged when layer 0
        is the prompt's; else the KV is dropped, the request prefills locally and its done line says why (kv_fidelity,
        kv_check), so the gateway demotes the pair. A check that cannot run never holds a request back."""
        from backends.decode.kv_check import traffic_check

        try:
            out = await asyncio.wrap_future(m.run_task(lambda: traffic_check(m, ids, kv)))
        except Exception as e:
            self.metrics.kv_checks.labels(m.model_id, "error").inc()
            log.warning("request %s: the real-traffic KV check could not run (%s: %s); decoding on the KV", rid,
                        type(e).__name__, e)
            return kv, arrived
        self.metrics.kv_check_seconds.labels(m.model_id).inc(out["seconds"])
        if out["ok"]:
            self.metrics.kv_checks.labels(m.model_id, "passed").inc()
            return kv, arrived
        self.metrics.kv_checks.labels(m.model_id, "failed").inc()
        what = out["message"]
        log.warning("request %s: KV of %d tokens failed the real-traffic check: %s; prefilling locally", rid,
                    out["tokens"], what)
        kv.release()
        return None, DoneLine("length", 0, 0, fallback_reason=Fallback.KV_FIDELITY, kv_check=what)

    async def _stream(self, resp, m: MLXModel, job: Job, done: DoneLine, t0: float) -> None:
        """Relay the job's tokens (stop strings matched here), then its done line, or an error line."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        freed = asyncio.Event()

        def put(ev) -> None:
            q.put_nowait(ev)
            if ev is None:
                freed.set()

        job.emit = lambda ev: loop.call_soon_threadsafe(put, ev)
        m.submit(job)
        stops, n, finish, ttft, error = StopMatcher(job.gen.stop), 0, "length", None, None
        tokens = self.metrics.tokens.labels(m.model_id)
        try:
            while (ev := await q.get()) is not None:
                if ev[0] == "error":
                    error = ev[1]
                    continue
                _, line, reason = ev
                n += 1
                tokens.inc()
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text, hit = stops.feed(line.text)
                if reason and not hit:
                    text += stops.flush()
                finish = "stop" if hit else (reason or finish)
                await _line(resp, replace(line, text=text).to_json())
                if hit:
                    break
        finally:
            job.cancel.set()  # a stop string or a client that left: the loop drops the job at its next step
            # Until the loop has dropped it the job still holds its KV cache: keep it counted in `running`.
            try:
                await asyncio.wait_for(freed.wait(), _STOP_WAIT_S)
            except asyncio.TimeoutError:
                log.warning("generation still in the MLX loop %.0fs after it was cancelled", _STOP_WAIT_S)
        if error is not None:
            await _line(resp, error_line(error))
            return
        await _line(resp, replace(done, finish_reason=finish, completion_tokens=n, ttft_s=ttft or 0.0).to_json())


def _drafter_layers(route) -> int:
    """The layers the prefill nodes' drafter adds to each KV stream: this node's own copy of it
    (speculative.draft_path: the same drafter for MLX) says how many (an EAGLE-3 head 1, a DFlash drafter its
    num_hidden_layers); 1 where this node has none to read."""
    path = _speculative(route).draft_path
    try:
        return drafter_layers(path) if path else 1
    except (OSError, ValueError):
        return 1


def _speculative(route):
    """The model's [models.speculative] with draft_path resolved like the model's own path (relative to config.toml)."""
    cfg = route.speculative
    if cfg.draft_path is None:
        return cfg
    return cfg.model_copy(update={"draft_path": str(resolve_model_path(route.model_copy(update={"path": cfg.draft_path})))})


def _head_digest(m: MLXModel) -> str | None:
    """The learned drafter this node drafts with (an EAGLE-3 head or a DFlash drafter: its prompt KV from the prefill
    node is judged by the canary beside the model's): a changed drafter moves the KV identity. None without one."""
    cfg = m.speculation.cfg
    return drafter_digest(cfg.draft_path) if {"eagle3", "dflash"} & set(cfg.sources) and cfg.draft_path else None


async def _line(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(json.dumps(obj).encode() + b"\n")


def serve(settings: Settings, node: NodeConfig) -> None:
    """Blocking: run the decode node described by `node` until SIGINT/SIGTERM."""
    svc = DecodeService(settings, node)
    app = node_app(svc.health, svc.start, svc.stop, token=node_token(settings, node), open_paths=open_paths(settings))
    app.router.add_post("/v1/generate", svc.generate)
    svc.metrics.route(app)

    async def abort(request: web.Request) -> web.Response:
        t = svc.receiver.transfers.get(request.match_info["rid"])
        if t is not None:
            t.fail("kv_aborted", "prefill side reported failure")
        return web.json_response({"aborted": t is not None})

    app.router.add_post("/v1/transfers/{rid}/abort", abort)
    from backends.probe import register_decode
    register_decode(app, svc)  # `disagg status`: KV link test transfers
    from backends.decode import canary
    canary.register(app, svc)  # the KV fidelity canary (kv_bridge/fidelity.py)
    # A client that leaves cancels its handler at once, even while it only waits for KV (no write to fail yet):
    # its transfer is forgotten and its job leaves the batch at the next step.
    run_app(app, node, handler_cancellation=True)


def _mlx_device() -> str:
    """The device MLX runs attention on (`Device(gpu, 0)` on a Mac's Metal, `Device(cpu, 0)` on mlx-cpu): its
    kernels, so its rounding, move with it."""
    import mlx.core as mx

    return f"mlx {mx.default_device()}"
