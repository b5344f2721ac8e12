"""Decode node: an aiohttp service around mlx-lm plus the KV receiver.

POST /v1/generate waits for the prompt's KV from a prefill node (bounded), builds mlx-lm caches from it and hands
the request to its model's batch loop; no KV in time: the loop prefills it locally. One MLX thread owns each model
and runs mlx-lm's BatchGenerator (continuous batching, driven as mlx_lm.server drives it): requests join and leave
the batch at any step without waiting for each other, and every token goes back to its request's asyncio queue, so
the event loop never blocks on compute. mlx-lm cannot batch quantized caches (QuantizedKVCache has no merge): with
decode.kv_bits the loop runs requests one at a time with stream_generate instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web

from backends.common import NodeError, bad_request, json_body, node_app, node_token, run_app
from backends.sampling import GenParams, StopMatcher, make_sampling, token_logprobs
from kv_bridge.config import NodeConfig, Settings, resolve_model_path
from kv_bridge.fingerprint import kv_spec, model_quantization
from kv_bridge.receiver import KVCapacityError, KVReceiver, TransferError

log = logging.getLogger(__name__)
_STOP_WAIT_S = 60.0  # longest wait for a cancelled generation to leave the MLX loop (one step or a local prefill)


@dataclass(eq=False)
class Job:
    """One generation for the MLX thread.

    `tokens`: the tokens still to run (at least the prompt's last). `make_cache`: builds the request's initial
    per-layer cache on the MLX thread (received KV, later a prefix cache with it appended); it holds `history`,
    the tokens before `tokens`. None: a fresh cache, the whole prompt is in `tokens`. `emit` gets
    ("token", line, finish_reason) per token or ("error", message), then None once the job has left the loop and
    its cache is freed. `on_finished(tokens, cache)` (MLX thread, must not block) gets the final per-request cache
    and the tokens it holds (history + prompt + every token delivered: BatchGenerator delivers a token once it
    has run it), for a finished or cancelled batched request.
    """

    tokens: list[int]
    gen: GenParams
    emit: Callable
    make_cache: Callable[[], list] | None = None
    history: list[int] = field(default_factory=list)
    on_finished: Callable[[list[int], list], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)


class MLXModel:
    """The model, its tokenizer and the one thread that may touch them."""

    def __init__(self, model_id: str, path: str, kv_bits: int | None = None, kv_group_size: int = 64,
                 max_batch_size: int = 32, prefix_cache_bytes: int = 0):
        from backends.prefix_cache import PrefixStore

        self.model_id, self.path = model_id, path
        self.kv_bits, self.kv_group_size, self.max_batch_size = kv_bits, kv_group_size, max_batch_size
        self.prefixes = PrefixStore(prefix_cache_bytes)  # finished generations' caches, for the next turn
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"mlx-{model_id}")
        self.model = self.tokenizer = None
        self.spec = kv_spec(path)
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.failure: str | None = None  # set when the MLX loop itself died: the node can serve nothing more
        self.batch_size = self.cache_bytes = 0  # published by the MLX thread after every step, read by /health

    def load(self) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm import load

        self.model, self.tokenizer = load(self.path)
        self.dtype = tree_flatten(self.model.parameters())[0][1].dtype
        # The logits width: what logit_bias ids and top_k are checked against.
        self.vocab_size = getattr(getattr(self.model, "args", None), "vocab_size", None) or len(self.tokenizer.vocab)
        mx.eval(self.model.parameters())
        if self.kv_bits is not None:  # refuse at start-up what quantization cannot do for this model
            from mlx_lm.models.cache import make_prompt_cache

            from kv_bridge.mlx.cache import quantize

            quantize(make_prompt_cache(self.model), self.kv_bits, self.kv_group_size)

    def start(self) -> None:
        """Start the MLX loop on the model's thread (after load)."""
        self.executor.submit(self._run)

    def stop(self) -> None:
        self._inbox.put(None)
        self.executor.shutdown(wait=False, cancel_futures=True)

    def submit(self, job: Job) -> None:
        """Any thread: queue a job; the loop admits it at its next step (or fails it, once the loop is dead)."""
        self._inbox.put(job)
        if self.failure is not None:  # the loop may have drained its inbox before this job arrived
            self._fail_queued()

    def _fail_queued(self) -> None:
        """Every queued job gets the loop's failure and leaves (any thread; the inbox hands each job out once)."""
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.emit(("error", self.failure))
                job.emit(None)

    def bridged_cache(self, kv) -> list:
        """MLX thread: the per-layer cache holding received KV, quantized as mlx-lm does after its own prefill."""
        from kv_bridge.mlx.cache import build_prompt_cache, quantize

        cache = build_prompt_cache(self.model, kv.keys, kv.values, self.dtype)
        return quantize(cache, self.kv_bits, self.kv_group_size)

    def prompt_cache(self, prefix, kv) -> list:
        """MLX thread: the request's initial cache: a private copy of the held prefix, extended by the received KV
        (which starts where the prefix ends), or the received KV alone."""
        from backends.prefix_cache import PrefixStore
        from kv_bridge.mlx.cache import append_kv

        try:
            if prefix is None:
                return self.bridged_cache(kv)
            cache = PrefixStore.take(prefix)
            if kv is not None:
                append_kv(cache, kv.keys, kv.values, self.dtype)
            return cache
        finally:
            if kv is not None:  # MLX copied the KV: the receive buffers can serve the next transfer
                kv.release()

    def keep(self, tokens: list[int], cache: list) -> None:
        """MLX thread (on_finished): offer a finished generation's cache to the prefix store for the next turn."""
        try:
            self.prefixes.store(self.model_id, tokens, cache)
        except ValueError:  # a cache that does not match what was fed is a bug, but never worth the answer
            log.exception("prefix store refused a finished generation's cache")

    def _run(self) -> None:
        """The MLX thread's loop: admit what arrived, step the batch, deliver, drop what finished or was cancelled."""
        batch = _Batch(self) if self.kv_bits is None else None
        try:
            while True:
                for job in self._arrivals(block=batch is None or not batch.jobs):
                    if job is None:
                        return
                    if batch is None:
                        self._run_alone(job)
                    else:
                        batch.add(job)
                if batch is not None:
                    batch.step()
                    self.batch_size, self.cache_bytes = len(batch.jobs), batch.nbytes()
        except Exception as e:  # the loop itself broke (not one request): nothing can be served any more
            log.exception("MLX loop for %s died", self.model_id)
            self.failure = f"the MLX loop for {self.model_id} died: {type(e).__name__}: {e}"
            if batch is not None:
                batch.abandon(self.failure)
            self._fail_queued()  # no request waits forever: /health now answers 503, the gateway fails over

    def _arrivals(self, block: bool) -> list[Job | None]:
        jobs = [self._inbox.get()] if block else []
        while True:
            try:
                jobs.append(self._inbox.get_nowait())
            except queue.Empty:
                return jobs

    def _run_alone(self, job: Job) -> None:
        """One quantized-cache generation with stream_generate (mlx-lm cannot batch QuantizedKVCache)."""
        from mlx_lm import stream_generate
        from mlx_lm.models.cache import make_prompt_cache

        try:
            if job.cancel.is_set():
                return
            cache = job.make_cache() if job.make_cache else make_prompt_cache(self.model)
            self.batch_size, self.cache_bytes = 1, _nbytes(cache)
            sampler, processors = make_sampling(job.gen, job.history, self.vocab_size)
            lead = _LeadingSpace(self.tokenizer)
            fed = [*job.history, *job.tokens]
            for r in stream_generate(self.model, self.tokenizer, job.tokens, max_tokens=job.gen.max_tokens,
                                     sampler=sampler, logits_processors=processors, prompt_cache=cache,
                                     kv_bits=self.kv_bits, kv_group_size=self.kv_group_size, quantized_kv_start=0):
                fed.append(r.token)
                line = _token_line(r.token, lead.fix(r.token, r.text), r.logprobs, job.gen)
                job.emit(("token", line, r.finish_reason))
                if job.cancel.is_set():
                    break
            if job.on_finished is not None:  # the store keeps as many of `fed` as the cache holds
                job.on_finished(fed, cache)
        except Exception as e:  # reported to the caller as an error line, never a dead stream
            log.exception("generation failed")
            job.emit(("error", f"{type(e).__name__}: {e}"))
        finally:
            self.batch_size = self.cache_bytes = 0
            job.emit(None)


@dataclass(eq=False)
class _Running:
    """A job in the batch and its own streaming detokenizer."""

    job: Job
    detokenizer: object
    lead: "_LeadingSpace"

    def text(self, token: int, finish_reason: str | None) -> str:
        """The token's text as stream_generate gives it: an EOS token adds none, the last token flushes."""
        if finish_reason != "stop":
            self.detokenizer.add_token(token)
        if finish_reason is not None:
            self.detokenizer.finalize()
        return self.lead.fix(token, self.detokenizer.last_segment)


class _Batch:
    """mlx-lm's BatchGenerator and the jobs in it, by uid. MLX thread only.

    Each job brings its own sampler and logits processors (BatchGenerator applies them row by row); its
    `history` goes in as the uid's `all_tokens`, so penalties see the prompt tokens whose KV came from prefill.
    EOS ends a row with finish_reason "stop"; stop strings are matched on the asyncio side, which cancels.
    """

    def __init__(self, m: MLXModel):
        self.m, self.jobs = m, {}
        self.gen = self._generator()

    def _generator(self):
        from mlx_lm.generate import BatchGenerator

        m = self.m
        return BatchGenerator(m.model, stop_tokens=[[t] for t in m.tokenizer.eos_token_ids],
                              completion_batch_size=m.max_batch_size, prefill_batch_size=min(8, m.max_batch_size))

    def add(self, job: Job) -> None:
        if job.cancel.is_set():
            job.emit(None)
            return
        try:
            cache = job.make_cache() if job.make_cache else None
            sampler, processors = make_sampling(job.gen, [], self.m.vocab_size)
            (uid,) = self.gen.insert([job.tokens], max_tokens=[job.gen.max_tokens], caches=[cache],
                                     all_tokens=[list(job.history)], samplers=[sampler],
                                     logits_processors=[processors])
        except Exception as e:
            log.exception("could not start generation")
            job.emit(("error", f"{type(e).__name__}: {e}"))
            job.emit(None)
            return
        self.jobs[uid] = _Running(job, self.m.tokenizer.detokenizer, _LeadingSpace(self.m.tokenizer))

    def step(self) -> None:
        self._drop([uid for uid, r in self.jobs.items() if r.job.cancel.is_set()])
        if not self.jobs:
            return
        try:
            _, responses = self.gen.next()
        except Exception as e:  # a failed step leaves the batch unusable: fail its jobs, start a fresh one
            log.exception("batch step failed")
            self._fail_all(f"{type(e).__name__}: {e}")
            return
        for r in responses:
            self._deliver(r)

    def nbytes(self) -> int:
        return self.gen.prompt_cache_nbytes

    def _deliver(self, r) -> None:
        run = self.jobs[r.uid]
        line = _token_line(r.token, run.text(r.token, r.finish_reason), r.logprobs, run.job.gen)
        run.job.emit(("token", line, r.finish_reason))
        if r.finish_reason is not None:  # BatchGenerator has already dropped the uid
            del self.jobs[r.uid]
            _finish(run.job, r.all_tokens, r.prompt_cache)

    def _drop(self, uids: list[int]) -> None:
        if not uids:
            return
        want = any(self.jobs[uid].job.on_finished for uid in uids)
        caches = self.gen.remove(uids, return_prompt_caches=want)
        for uid in uids:
            cache, tokens = caches.get(uid, (None, None))
            _finish(self.jobs.pop(uid).job, tokens, cache)

    def _fail_all(self, message: str) -> None:
        self.abandon(message)
        self.gen = self._generator()

    def abandon(self, message: str) -> None:
        """Every job in the batch gets `message` as its error and leaves; the generator is closed."""
        for run in self.jobs.values():
            run.job.emit(("error", message))
            run.job.emit(None)
        self.jobs.clear()
        try:
            self.gen.close()
        except Exception:  # a generator that broke may not close cleanly; it is dropped either way
            log.exception("closing the batch generator failed")


def _finish(job: Job, tokens: list[int] | None, cache: list | None) -> None:
    """Hand the final cache on (if anyone wants it), then tell the request it has left the loop."""
    try:
        if job.on_finished is not None and cache is not None:
            job.on_finished(list(tokens), cache)
    except Exception:
        log.exception("on_finished failed")
    finally:
        job.emit(None)


def _nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


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


def _token_line(token: int, text: str, logprobs, gen: GenParams) -> dict:
    """The NDJSON token line for one sampled token (MLX thread: logprobs read an mx.array)."""
    line = {"type": "token", "token_id": token, "text": text}
    if gen.logprobs is not None:
        line["logprob"], line["top_logprobs"] = token_logprobs(logprobs, token, gen.logprobs)
    return line


class DecodeService:
    def __init__(self, settings: Settings, node: NodeConfig):
        self.settings, self.node = settings, node
        d = settings.decode
        self.models = {m.id: MLXModel(m.id, str(resolve_model_path(m)), d.kv_bits, d.kv_group_size, d.max_batch_size,
                                      d.prefix_cache_bytes)
                       for m in settings.models if node.name in m.decode}
        if not self.models:
            raise NodeError(500, f"no model in config.toml lists decode node {node.name!r}; add it to a model's decode pool")
        self.receiver = KVReceiver(settings.kv, settings.auth.kv_key(), settings.auth.kv_frame_mac)
        self.running = 0
        # on_finished(model_id, tokens, cache) on the MLX thread when a batched generation ends, after the prefix
        # store has seen it (tests hook in here).
        self.on_finished: Callable[[str, list[int], list], None] | None = None

    async def start(self, app: web.Application) -> None:
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
                "quantization": {mid: model_quantization(m.path) for mid, m in self.models.items()}}

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
        if m.failure is not None:
            raise NodeError(503, m.failure, "engine_dead")
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
            await self._stream(resp, m, self._job(m, ids, kv, gen, prefix), done, t0, len(ids))
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("request %s: client went away", rid)
            raise
        finally:
            self.running -= 1
            if transfer is not None:
                self.receiver.forget(rid)
        return resp

    def _job(self, m: MLXModel, ids: list[int], kv, gen: GenParams, prefix=None) -> Job:
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
                   on_finished=finished if m.prefixes.enabled or hook is not None else None)

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

    async def _stream(self, resp, m: MLXModel, job: Job, done: dict, t0: float, prompt_tokens: int) -> None:
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
        try:
            while (ev := await q.get()) is not None:
                if ev[0] == "error":
                    error = ev[1]
                    continue
                _, line, reason = ev
                n += 1
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text, hit = stops.feed(line["text"])
                if reason and not hit:
                    text += stops.flush()
                finish = "stop" if hit else (reason or finish)
                await _line(resp, {**line, "text": text})
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
            await _line(resp, {"type": "error", "message": error})
            return
        await _line(resp, {"type": "done", "finish_reason": finish, "prompt_tokens": prompt_tokens,
                           "completion_tokens": n,
                           "computed_tokens": prompt_tokens - done["kv_tokens"] - done["prefix_tokens"],
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
    from backends.probe import register_decode
    register_decode(app, svc)  # `disagg status`: KV link test transfers
    # A client that leaves cancels its handler at once, even while it only waits for KV (no write to fail yet):
    # its transfer is forgotten and its job leaves the batch at the next step.
    run_app(app, node, handler_cancellation=True)
