"""Decode node: an aiohttp service around mlx-lm plus the KV receiver.

POST /v1/generate waits for the prompt's KV from a prefill node (bounded), builds mlx-lm caches from it, runs
the remaining prompt token(s), samples and streams tokens as NDJSON. No KV in time: it prefills locally.
A prompt prefix this node still holds (backends/prefix_cache.py) is reused; only the KV after it is moved.
One MLX thread owns the model; the event loop never blocks on compute.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from backends.common import NodeError, bad_request, json_body, node_app, node_token, run_app
from backends.sampling import GenParams, StopMatcher, make_sampling, token_logprobs
from kv_bridge.config import NodeConfig, Settings, resolve_model_path
from kv_bridge.fingerprint import kv_spec
from kv_bridge.receiver import KVCapacityError, KVReceiver, TransferError

log = logging.getLogger(__name__)
_STOP_WAIT_S = 60.0  # longest wait for a cancelled generation's MLX step (or local prefill) to finish


class MLXModel:
    """The model, its tokenizer and the one thread that may touch them."""

    def __init__(self, model_id: str, path: str, kv_bits: int | None = None, kv_group_size: int = 64,
                 prefix_cache_bytes: int = 0):
        self.model_id, self.path = model_id, path
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.prefix_cache_bytes = prefix_cache_bytes
        self.prefixes = None  # PrefixStore, made with the model (it needs mlx)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"mlx-{model_id}")
        self.model = self.tokenizer = None
        self.spec = kv_spec(path)

    def load(self) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm import load

        from backends.prefix_cache import PrefixStore

        self.prefixes = PrefixStore(self.prefix_cache_bytes)
        self.model, self.tokenizer = load(self.path)
        self.dtype = tree_flatten(self.model.parameters())[0][1].dtype
        # The logits width: what logit_bias ids and top_k are checked against.
        self.vocab_size = getattr(getattr(self.model, "args", None), "vocab_size", None) or len(self.tokenizer.vocab)
        mx.eval(self.model.parameters())
        if self.kv_bits is not None:  # refuse at start-up what quantization cannot do for this model
            from mlx_lm.models.cache import make_prompt_cache

            from kv_bridge.mlx_cache import quantize

            quantize(make_prompt_cache(self.model), self.kv_bits, self.kv_group_size)

    def generate(self, ids: list[int], kv, gen: GenParams, emit, cancel: threading.Event, prefix=None) -> None:
        """Runs on the MLX thread: emit(("token", line, finish_reason)) for each sampled token, then emit(None).
        `prefix`: a PrefixStore match for ids; `kv` then holds the KV after it (or is None: prefill the rest here)."""
        import mlx.core as mx
        from mlx_lm import stream_generate

        try:
            cache, start = self._prompt_cache(kv, prefix)
            if gen.seed is not None:
                mx.random.seed(gen.seed)
            sampler, processors = make_sampling(gen, ids[:start], self.vocab_size)
            lead = _LeadingSpace(self.tokenizer)
            fed = list(ids)
            for r in stream_generate(self.model, self.tokenizer, mx.array(ids[start:]), max_tokens=gen.max_tokens,
                                     sampler=sampler, logits_processors=processors, prompt_cache=cache,
                                     **self._kv_quant()):
                fed.append(r.token)
                emit(("token", {**_token_line(r, gen), "text": lead.fix(r.token, r.text)}, r.finish_reason))
                if cancel.is_set():
                    break
            self._keep(fed, cache)
        except Exception as e:  # reported to the caller as an error line, never a dead stream
            log.exception("generation failed")
            emit(("error", f"{type(e).__name__}: {e}"))
        finally:
            emit(None)


    def _keep(self, fed: list[int], cache: list) -> None:
        """Offer the finished cache to the prefix store: the next turn of this conversation starts from it."""
        try:
            self.prefixes.store(self.model_id, fed, cache)
        except ValueError:  # a cache that does not match what was fed is a bug, but never worth the answer
            log.exception("prefix store refused a finished generation's cache")

    def _prompt_cache(self, kv, prefix) -> tuple[list, int]:
        """(cache, tokens it holds): the reused prefix's copy extended by the received KV, or the received KV alone,
        or the prefix alone (decode computes the rest), or an empty cache."""
        from mlx_lm.models.cache import make_prompt_cache

        from backends.prefix_cache import PrefixStore
        from kv_bridge.mlx_cache import append_kv, build_prompt_cache, quantize

        if prefix is not None:
            cache = PrefixStore.take(prefix)
            if kv is not None:
                append_kv(cache, kv.keys, kv.values, self.dtype)
            return cache, prefix.tokens + (kv.keys.shape[2] if kv is not None else 0)
        if kv is None:
            return make_prompt_cache(self.model), 0
        cache = build_prompt_cache(self.model, kv.keys, kv.values, self.dtype)
        quantize(cache, self.kv_bits, self.kv_group_size)  # as mlx-lm does after its own prefill
        return cache, kv.keys.shape[2]

    def _kv_quant(self) -> dict:
        if self.kv_bits is None:
            return {}
        return {"kv_bits": self.kv_bits, "kv_group_size": self.kv_group_size, "quantized_kv_start": 0}


class _LeadingSpace:
    """mlx-lm's BPE streaming detokenizer drops the leading space of the first text it emits (" Paris" -> "Paris");
    vLLM and the tokenizer's own decode keep it, and a raw completion needs it. Restore it on the first segment."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.settled = tokenizer, [], False

    def fix(self, token: int, text: str) -> str:
        if self.settled:
            return text
        self.ids.append(token)
        if not text:
            return text
        self.settled = True
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return " " + text if full.startswith(" ") and not text.startswith(" ") else text


def _token_line(r, gen: GenParams) -> dict:
    """The NDJSON token line for one GenerationResponse (MLX thread: logprobs read an mx.array)."""
    line = {"type": "token", "token_id": r.token, "text": r.text}
    if gen.logprobs is not None:
        line["logprob"], line["top_logprobs"] = token_logprobs(r.logprobs, r.token, gen.logprobs)
    return line


class DecodeService:
    def __init__(self, settings: Settings, node: NodeConfig):
        self.settings, self.node = settings, node
        d = settings.decode
        self.models = {m.id: MLXModel(m.id, str(resolve_model_path(m)), d.kv_bits, d.kv_group_size,
                                      d.prefix_cache_bytes)
                       for m in settings.models if node.name in m.decode}
        if not self.models:
            raise NodeError(500, f"no model in config.toml lists decode node {node.name!r}; add it to a model's decode pool")
        self.receiver = KVReceiver(settings.kv, settings.auth.kv_key(), settings.auth.kv_frame_mac)
        self.running = 0

    async def start(self, app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        for m in self.models.values():
            await loop.run_in_executor(m.executor, m.load)
        await self.receiver.start(self.node.host, self.node.kv_port)
        log.info("decode node %s: models %s, KV on %s:%d", self.node.name, list(self.models), self.node.host,
                 self.node.kv_port)

    async def stop(self, app: web.Application) -> None:
        await self.receiver.stop()
        for m in self.models.values():
            m.executor.shutdown(wait=False, cancel_futures=True)

    def health(self) -> dict:
        return {"role": "decode", "models": list(self.models), "running": self.running, "kv_port": self.node.kv_port,
                "transfers": len(self.receiver.transfers),  # registered and not yet settled: 0 when idle
                "fingerprint": {mid: m.spec["fingerprint"] for mid, m in self.models.items()}}

    def _parse(self, body: dict) -> tuple[MLXModel, list[int], int, GenParams]:
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
        gen = GenParams.parse(body)
        gen.check_vocab(m.vocab_size)
        return m, ids, kv_tokens, gen

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        m, ids, kv_tokens, gen = self._parse(body)
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        if rid in self.receiver.transfers:
            raise NodeError(409, f"request_id {rid!r} is already in flight on this node", "duplicate_request")
        # The decode node always runs the last prompt token itself, so a prefix covers at most len(ids) - 1.
        prefix = m.prefixes.match(m.model_id, ids, kv_tokens or len(ids) - 1)
        p = prefix.tokens if prefix is not None else 0
        try:
            transfer = self.receiver.expect(rid, kv_tokens, m.spec, start=p) if kv_tokens > p else None
        except KVCapacityError as e:  # backpressure: the gateway tries another node, then answers 429
            raise NodeError(429, str(e), "kv_capacity", {"Retry-After": "1"}) from None
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        self.running += 1
        try:
            await resp.prepare(request)
            await _line(resp, {"type": "accepted", "request_id": rid, **({"kv_start": p} if kv_tokens else {})})
            t0 = time.perf_counter()
            kv, done = await self._await_kv(transfer, kv_tokens - p)
            done["prefix_tokens"] = p
            await self._stream(resp, m, ids, kv, gen, done, t0, prefix)
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("request %s: client went away", rid)
            raise
        finally:
            self.running -= 1
            if transfer is not None:
                self.receiver.forget(rid)
        return resp

    async def _await_kv(self, transfer, kv_tokens: int):
        done = {"kv_tokens": 0, "fallback_reason": None, "kv_transfer_s": 0.0, "kv_bytes": 0}
        if transfer is None:
            return None, done
        try:
            kv = await transfer.result(self.settings.decode.kv_timeout_s)
        except TransferError as e:
            log.warning("transfer %s: %s; prefilling locally", transfer.transfer_id, e)
            done["fallback_reason"] = e.reason
            return None, done
        done.update(kv_tokens=kv_tokens, kv_transfer_s=kv.seconds, kv_bytes=kv.nbytes)
        return kv, done

    async def _stream(self, resp, m: MLXModel, ids, kv, gen: GenParams, done: dict, t0: float, prefix=None) -> None:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        emit = lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev)  # noqa: E731
        fut = loop.run_in_executor(m.executor, m.generate, ids, kv, gen, emit, cancel, prefix)
        stops, n, finish, ttft = StopMatcher(gen.stop), 0, "length", None
        try:
            while (ev := await q.get()) is not None:
                if ev[0] == "error":
                    await _line(resp, {"type": "error", "message": ev[1]})
                    return
                _, line, reason = ev
                n += 1
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text, hit = stops.feed(line["text"])
                if reason and not hit:
                    text += stops.flush()
                finish = "stop" if hit else (reason or finish)
                await _line(resp, {**line, "text": text})
                if hit:
                    cancel.set()
                    break
        finally:
            cancel.set()  # a client that left stops the MLX loop at its next token
            if not fut.done():
                # Until the MLX thread has left its loop it still holds this request's KV cache: keep it counted in
                # `running` until then (one decode step, or the rest of a local prefill).
                await asyncio.wait({fut}, timeout=_STOP_WAIT_S)
                if not fut.done():
                    log.warning("generation still running %.0fs after it was cancelled", _STOP_WAIT_S)
        await fut
        await _line(resp, {"type": "done", "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": n,
                           "computed_tokens": len(ids) - done["kv_tokens"] - done["prefix_tokens"],
                           "ttft_s": ttft or 0.0, **done})


async def _line(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(json.dumps(obj).encode() + b"\n")


def serve(settings: Settings, node: NodeConfig) -> None:
    """Blocking: run the decode node described by `node` until SIGINT/SIGTERM."""
    svc = DecodeService(settings, node)
    app = node_app(svc.health, svc.start, svc.stop, token=node_token(settings, node))
    app.router.add_post("/v1/generate", svc.generate)

    async def abort(request: web.Request) -> web.Response:
        t = svc.receiver.transfers.get(request.match_info["rid"])
        if t is not None:
            t.fail("kv_aborted", "prefill side reported failure")
        return web.json_response({"aborted": t is not None})

    app.router.add_post("/v1/transfers/{rid}/abort", abort)
    run_app(app, node)
