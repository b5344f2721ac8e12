"""One generation across nodes, per docs/protocol.md and docs/routing.md: choose the path by predicted time to first
token (gateway/cluster/rates.py), wait for the prefill node's admission (gateway/cluster/admission.py), open the
decode stream, then (disaggregated path) ask a prefill node to push KV for prompt[kv_start:-1] to the decode node
(which holds the KV of the first kv_start tokens already; none to push when that is all of them); abort the transfer
if prefill fails. `Choices` runs n such generations of one prompt concurrently and merges their streams. Fallbacks,
in order, each counted in disagg_fallbacks_total{reason} and listed in x-disagg-fallbacks: another decode node when
one refuses or fails before its stream starts (decode_node_failed), or when its stream breaks after that
(decode_failover: `Resumable` continues the same stream there); another prefill node when one cannot be reached
(prefill_node_failed); decode-local prefill when the KV does not arrive (kv_timeout, kv_error, kv_aborted: path
"fallback"); the model's configured upstream through litellm (upstream: path "upstream"); then, when the pool is only
full (or the model at its max_inflight, or the prefill admission queue full), the request waits in the gateway's queue
(gateway/cluster/queue.py) and retries; past the queue's bounds ServerBusy, and 503 when no node is healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import AsyncIterator, Callable

import aiohttp

from kv_bridge.config.models import ModelRoute
from kv_bridge.config.settings import Settings
from kv_bridge.protocol import SEED_SPACE, DoneLine, Fallback, Sampling, TokenLine

from gateway.errors import InvalidRequest, NodeBusy, NodeUnavailable, NoHealthyNode, RateLimited, UpstreamError
from gateway.cluster.attempt import Attempt, GenerationStream
from gateway.cluster.failover import Resumable
from gateway.cluster.admission import Admission, Ticket
from gateway.cluster.generation import Generation, PrefillRoute
from gateway.cluster.node_client import NodeClient
from gateway.cluster.nodes import Lease, NodePool, NodeState, PrefixAffinity
from gateway.cluster.rates import DISAGGREGATED, Rates, choose_path
from gateway.cluster.queue import RequestQueue, Waiting
from gateway.cluster.upstream import Prompt, UpstreamGeneration, check_upstreams

log = logging.getLogger("gateway.cluster.orchestrator")


class Orchestrator:
    """Admission (max_inflight), node choice and the fallbacks in order; every generation it opens holds a `Lease`
    (in-flight counts, affinity) that the generation releases when it closes."""

    def __init__(self, settings: Settings, session: aiohttp.ClientSession, pool: NodePool,
                 detokenize: Callable[[str, list[int]], str] | None = None,
                 usable: Callable[[str, str, str], bool] | None = None,
                 demote: Callable[[str, str, str, str], None] | None = None) -> None:
        check_upstreams(settings.models)
        # (model, prefill node, decode node) -> may it carry KV now (the fidelity canary, gateway/cluster/fidelity.py)
        self._usable = usable or (lambda model, prefill, decode: True)
        self._demote = demote  # (model, prefill, decode, finding): a request's KV failed the decode node's check
        # (model id, token ids) -> text; a mid-stream failover recomputes the text the broken node held back with it.
        self._detokenize = detokenize
        self.pool = pool
        self.metrics = pool.metrics
        self.metrics.declare(m.id for m in settings.models)
        self.client = NodeClient(session, pool, settings.gateway.request_timeout_s)
        gw = settings.gateway
        self.retry_after_s, self.affinity_slack = gw.retry_after_s, gw.affinity_slack
        self.prefill_stall_s = gw.prefill_stall_s
        self.affinity = PrefixAffinity(gw.affinity_entries, gw.affinity_block_tokens)
        self.inflight: dict[str, int] = {}  # generations per model, decode and upstream alike
        self._starting: dict[str, int] = {}  # per model: requests past the max_inflight check, not yet leased
        self._model_ids = [m.id for m in settings.models]
        max_queued = {m.id: gw.queue.max_queued if m.max_queued is None else m.max_queued for m in settings.models}
        self.queue = RequestQueue(gw.queue, lambda model: max_queued.get(model, gw.queue.max_queued),
                                  self.retry_after_s, self.metrics.queue_waited, self._refused)
        self.rates = Rates(gw.rates)
        self.admission = Admission(gw.admission, lambda node: self.rates.prefill_rate(node).value)
        self.metrics.refreshers.append(self._refresh_metrics)

    def detokenize(self, model_id: str, ids: list[int]) -> str | None:
        return None if self._detokenize is None else self._detokenize(model_id, ids)

    def _lease(self, route: ModelRoute, node: NodeState | None, prefix: list[bytes] | None = None,
               local_tokens: int = 0) -> Lease:
        return Lease(self.inflight, route.id, node, self.affinity, prefix, local_tokens, on_release=self.queue.notify)

    def choose_prefill(self, route: ModelRoute, prompt: list[int], decode: NodeState,
                       exclude: list[str] = (), leased: bool = False) -> NodeState | None:
        """The prefill node to wait for, or None for local prefill: above the `min_disagg_tokens` floor, the prefill
        node with the lowest predicted time to first token (its queue and this prompt at its learned rate, plus the
        transfer), unless the decode node prefilling the prompt itself (behind its other local prefills) is sooner by
        more than the stall that would impose on the node's other generations (gateway/cluster/rates.py, `local_stall`).
        `leased`: the asking generation already holds a lease on `decode` (a reroute), so it is not one of them."""
        return self.plan(route, prompt, decode, exclude, leased)[0]

    def plan(self, route: ModelRoute, prompt: list[int], decode: NodeState, exclude: list[str] = (),
             leased: bool = False) -> tuple[NodeState | None, float]:
        """(the prefill node to wait for or None, the predicted seconds to first token of the path chosen)."""
        kv_tokens = len(prompt) - 1
        if kv_tokens < route.min_disagg_tokens:
            return None, self.rates.local_ttft(decode.name, kv_tokens, decode.local_tokens, route.id)
        others = max(0, decode.inflight - leased)
        priced = [(self.rates.costs(node.name, decode.name, kv_tokens, tokens_ahead=self.admission.node(
            node.name).tokens_ahead, batch_tokens=decode.local_tokens, others=others, arriving=decode.waiting,
            kv_bytes_per_token=int(self.rates.kv_bytes_per_token.get(route.id, 0)), model=route.id), node)
            for node in self.pool.available(route.prefill, exclude) if self._usable(route.id, node.name, decode.name)]
        if not priced:
            return None, self.rates.local_ttft(decode.name, kv_tokens, decode.local_tokens, route.id)
        costs, node = min(priced, key=lambda cn: cn[0].disaggregated)
        if choose_path(costs, kv_tokens, route.min_disagg_tokens) == DISAGGREGATED:
            return node, costs.disaggregated
        log.info("%d prompt tokens go local on %s: predicted TTFT %.1fs + %.1fs of stall to %d generations there "
                 "(%d on the way), against %.1fs waiting for %s", kv_tokens, decode.name, costs.local, costs.stall,
                 others, decode.waiting, costs.disaggregated, node.name)
        return None, costs.local

    async def _admit(self, route: ModelRoute, node: NodeState, tokens: int) -> Ticket:
        return await self.admission.node(node.name).acquire(route.id, tokens)

    def snapshot(self) -> dict:
        """For /health: the learned rates and each prefill node's admission state."""
        return {"rates": self.rates.snapshot(), "admission": self.admission.snapshot(), "queue": self.queue.snapshot()}

    def _refused(self, model: str, reason: str) -> None:
        self.metrics.fallback(model, Fallback.NO_CAPACITY)
        self.metrics.queue_refused.labels(model, reason).inc()

    def _refresh_metrics(self, m) -> None:
        snap = self.rates.snapshot()
        for kind, key in (("prefill", "prefill_tokens_per_s"), ("local_prefill", "local_prefill_tokens_per_s"),
                          ("link", "link_bytes_per_s")):
            for node, r in snap[key].items():
                m.rate.labels(kind, node).set(r["value"])
        for model in self._model_ids:
            m.queue_length.labels(model).set(self.queue.length(model))
        for node, gate in self.admission.nodes.items():
            m.admission_tokens.labels(node, "inflight").set(gate.inflight_tokens)
            m.admission_tokens.labels(node, "queued").set(gate.queued_tokens)

    async def start(self, route: ModelRoute, prompt: Prompt, samplings: list[Sampling],
                    waiting: Waiting | None = None) -> list[GenerationStream]:
        """One generation per sampling (a request's n choices), opened together (`_start`), the request waiting in
        the model's queue while the model or its pool is only busy; ServerBusy past the queue's bounds, 503 when
        nothing can serve. All or none: a request holding some choices' slots while it waits for the others' could
        wait on itself."""
        limit, need = route.max_inflight, len(samplings)
        if limit is not None and need > limit:
            raise InvalidRequest(f"{need} choices need more generations at once than model {route.id!r} runs (its "
                                 f"max_inflight is {limit})", param="n")
        return await self.queue.run(route.id, lambda: self._start(route, prompt, samplings), waiting)

    async def _start(self, route: ModelRoute, prompt: Prompt, samplings: list[Sampling]) -> list[GenerationStream]:
        """Each choice on the conversation's decode node or the least-loaded one, then the next on failure, then the
        upstream; RateLimited at the model's limit or when every node is full (no choice kept open), 503 when
        nothing can serve."""
        limit, model, need = route.max_inflight, route.id, len(samplings)
        # Requests still opening (waiting for prefill admission) count too, so a queue let loose keeps the limit.
        if limit is not None and self.inflight.get(model, 0) + self._starting.get(model, 0) + need > limit:
            raise RateLimited(f"model {model!r} has {limit} generations in flight (its max_inflight); retry in "
                              f"{self.retry_after_s}s", self.retry_after_s)
        self._starting[model] = self._starting.get(model, 0) + need
        try:
            results = await asyncio.gather(*(self._open(route, prompt, s) for s in samplings), return_exceptions=True)
        finally:
            self._starting[model] -= need
        gens = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(g.close() for g in gens))
            # Busy only if every failure was: then the request waits and retries all of them.
            raise next((e for e in errors if not isinstance(e, RateLimited)), errors[0])
        return gens

    async def _open(self, route: ModelRoute, prompt: Prompt, sampling: Sampling) -> GenerationStream:
        prefix = self.affinity.hashes(route.id, prompt.ids)
        prefer = self._remembered(route, prefix)
        attempt = Attempt()
        gen = await self.open_on_pool(route, prompt.ids, sampling, attempt, prefix, prefer)
        if gen is None:
            return await self._beyond_the_pool(route, prompt, sampling, attempt)

        async def reopen(ids: list[int], s: Sampling, attempt: Attempt) -> Generation | None:
            return await self.open_on_pool(route, ids, s, attempt, self.affinity.hashes(route.id, ids))
        return Resumable(gen, sampling, reopen, self.metrics, self.client.check, self.detokenize)

    async def open_on_pool(self, route: ModelRoute, prompt: list[int], sampling: Sampling, attempt: Attempt,
                           prefix: list[bytes], prefer: str | None = None) -> Generation | None:
        """A generation opened on the first decode node of the pool that accepts it (skipping `attempt.tried`, to
        which each node that fails is added with its reason), or None when no node is left."""
        tried = attempt.tried
        while True:
            decode = self.pool.pick(route.decode, exclude=tried, prefer=prefer, slack=self.affinity_slack)
            if not tried and prefer is not None:
                self.metrics.affinity.labels(route.id, "hit" if decode and decode.name == prefer else "skipped").inc()
            if decode is None:
                return None
            gen = await self._generation(route, decode, prompt, attempt.fallbacks, prefix)
            try:
                await gen.open(sampling)
                return gen
            except UpstreamError as e:  # refused or failed before its stream started: the next node may serve
                await gen.close()
                if isinstance(e, NodeUnavailable):
                    self.pool.mark(decode, False, e.message)
                busy = isinstance(e, NodeBusy)
                reason = Fallback.DECODE_NODE_BUSY if busy else Fallback.DECODE_NODE_FAILED
                log.warning("decode node %s %s before streaming (%s); trying the next", decode.name,
                            "was busy" if busy else "failed", e.message)
                attempt.failed(decode.name, reason, busy)
                self.metrics.fallback(route.id, reason)
            except BaseException:
                await gen.close()
                raise

    async def _generation(self, route: ModelRoute, decode: NodeState, prompt: list[int], fallbacks: list[str],
                          prefix: list[bytes]) -> Generation:
        """A generation on `decode`, its path chosen by cost. A disaggregated one waits here for its prefill node's
        admission (arrival order, fair per model; RateLimited past the queue) before the decode node is asked, so
        queueing never runs down the decode node's no-progress deadline."""
        prefill, predicted = self.plan(route, prompt, decode)
        self.metrics.path_choice.labels(route.id, "disaggregated" if prefill else "local").inc()
        ticket = None
        if prefill is not None:
            decode.waiting += 1
            try:
                ticket = await self._admit(route, prefill, len(prompt) - 1)
            finally:
                decode.waiting -= 1
        reroute = PrefillRoute(lambda tried: self.choose_prefill(route, prompt, decode, tried, leased=True),
                               lambda node, tokens: self._admit(route, node, tokens), self.prefill_stall_s)
        lease = self._lease(route, decode, prefix, 0 if prefill else len(prompt))
        return Generation(self.client, lease, route, decode, prefill, prompt, fallbacks, ticket=ticket,
                          rates=self.rates, reroute=reroute, predicted_ttft_s=predicted, demote=self._demote)

    def _remembered(self, route: ModelRoute, prefix: list[bytes]) -> str | None:
        """The decode node that served this prompt's longest remembered prefix, if it is in the model's pool."""
        if not self.affinity.enabled:
            return None
        hit = self.affinity.lookup(prefix)
        if hit is None or hit[0] not in route.decode:
            self.metrics.affinity.labels(route.id, "miss").inc()
            return None
        return hit[0]

    async def _beyond_the_pool(self, route: ModelRoute, prompt: Prompt, sampling: Sampling,
                               attempt: Attempt) -> UpstreamGeneration:
        """No decode node can serve: the upstream when one is configured and the request can go there; else 429
        when healthy nodes are only full (at max_inflight, or refusing with 429), 503 when none is healthy."""
        tried, fallbacks = attempt.tried, attempt.fallbacks
        full = [*attempt.busy, *(n.name for n in self.pool.healthy(route.decode) if n.name not in tried and n.full)]
        why = (f"every decode node of model {route.id!r} is full: at its max_inflight or in-flight KV cap "
               f"({', '.join(full)})" if full else
               f"no healthy decode node for model {route.id!r}" + (f" (tried {', '.join(tried)})" if tried else ""))
        if route.upstream is not None and prompt.upstream is not None and sampling.logprobs is None:
            gen = UpstreamGeneration(self._lease(route, None), route, prompt.ids, prompt.upstream,
                                     [*fallbacks, Fallback.UPSTREAM])
            try:
                await gen.open(sampling)
            except UpstreamError as e:
                await gen.close()
                log.warning("%s, and the upstream failed: %s", why, e.message)
                why += f"; the upstream failed: {e.message}"
            except BaseException:
                await gen.close()
                raise
            else:
                log.info("%s; serving from the upstream %s", why, route.upstream.model)
                self.metrics.fallback(route.id, Fallback.UPSTREAM)
                return gen
        if full:  # only busy: the request waits in the queue and retries (no_capacity is counted if it gives up)
            raise RateLimited(f"{why}; retry in {self.retry_after_s}s", self.retry_after_s)
        self.metrics.fallback(route.id, Fallback.NO_CAPACITY)
        raise NoHealthyNode(f"{why}; retry later")

def per_choice(sampling: Sampling, n: int) -> list[Sampling]:
    """One Sampling per choice. A seed is offset by the choice index (as vLLM does), so a seeded n=2 request
    gives two different, reproducible choices rather than two copies."""
    if sampling.seed is None:
        return [replace(sampling) for _ in range(n)]
    return [replace(sampling, seed=(sampling.seed + i) % SEED_SPACE) for i in range(n)]


class Choices:
    """Start with `start()`, iterate `events()`: (index, Token) per token, (index, None) when choice `index`
    is done (its `done` line is then in `dones[index]`). Always `close()`."""

    def __init__(self, orch: Orchestrator, route: ModelRoute, prompt: Prompt, samplings: list[Sampling],
                 waiting: Waiting | None = None) -> None:
        self._orch, self.route, self.prompt, self.samplings = orch, route, prompt, samplings
        self.waiting = waiting
        self.gens: list[GenerationStream] = []
        self._pumps: list[asyncio.Task] = []
        self._closed = False

    @property
    def n(self) -> int:
        return len(self.samplings)

    async def start(self) -> None:
        """Open every generation, together (Orchestrator.start); if any cannot start, none is kept and its error is
        raised."""
        self.gens = await self._orch.start(self.route, self.prompt, self.samplings, self.waiting)

    @property
    def first(self) -> GenerationStream:
        return self.gens[0]

    def headers(self) -> dict[str, str]:
        """The first choice's node headers, and how long the request waited in the gateway's queue; the predicted time
        to first token counts that wait too, as Ollama's prompt_eval_duration does (both from the request's start)."""
        waited_ms = (self.waiting.waited_s if self.waiting is not None else 0.0) * 1000.0
        out = {**self.first.headers(), "x-disagg-queue-ms": f"{waited_ms:.1f}"}
        if "x-disagg-predicted-ttft-ms" in out:
            out["x-disagg-predicted-ttft-ms"] = f"{float(out['x-disagg-predicted-ttft-ms']) + waited_ms:.1f}"
        return out

    @property
    def dones(self) -> list[DoneLine | None]:
        return [g.done for g in self.gens]

    async def events(self) -> AsyncIterator[tuple[int, TokenLine | None]]:
        """Tokens of all choices in arrival order; the first failing choice's error is raised here."""
        q: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(i, g, q)) for i, g in enumerate(self.gens)]
        running = len(self.gens)
        while running:
            index, item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
            yield index, item

    @staticmethod
    async def _pump(index: int, gen: GenerationStream, q: asyncio.Queue) -> None:
        try:
            async for tok in gen.tokens():
                q.put_nowait((index, tok))
            q.put_nowait((index, None))
        except Exception as e:  # handed to the consumer, which raises it where the client can be told
            q.put_nowait((index, e))

    async def close(self) -> None:
        """Stop reading, then close every generation (an unfinished one tells its decode node to stop)."""
        if self._closed:
            return
        self._closed = True
        for t in self._pumps:
            t.cancel()
        for t in self._pumps:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await asyncio.gather(*(g.close() for g in self.gens))
