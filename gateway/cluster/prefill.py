"""The prefill call of one disaggregated generation, per docs/protocol.md: ask a prefill node to push the KV of
prompt[kv_start:-1] to the decode node; another prefill node when one cannot be reached (prefill_node_failed);
abort the transfer when none can, and the decode node prefills locally (path "fallback")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Awaitable, Callable

import aiohttp

from kv_bridge.config.models import ModelRoute
from kv_bridge.protocol import Fallback

from gateway.errors import RateLimited
from gateway.cluster.node_client import NodeClient, error_text
from gateway.cluster.admission import Ticket
from gateway.cluster.nodes import NodeState
from gateway.cluster.rates import Rates

log = logging.getLogger("gateway.cluster.orchestrator")

# While a prefill call runs, how often to look whether health checks marked its node down (then abort at once).
_DOWN_CHECK_S = 0.5


class PrefillRoute:
    """What a generation needs to find and enter a prefill node, as values: `choose(exclude)` the node worth waiting
    for (cost model) or None, `admit(node, tokens)` its admission ticket (may queue; RateLimited past the queue)."""

    def __init__(self, choose: Callable[[list[str]], NodeState | None],
                 admit: Callable[[NodeState, int], Awaitable[Ticket]], stall_s: float = float("inf")) -> None:
        self.choose, self.admit, self.stall_s = choose, admit, stall_s


class PrefillCall:
    """The prefill side of generation `request_id` on `decode`: `run()` once the decode node said which prefix it
    holds (`kv_start`); `node` the prefill node asked last, `seconds` the call that answered 200, `ms` the wall time of
    all of them. `fallbacks` is the generation's own list (reasons appended in order). Always `release()`."""

    def __init__(self, client: NodeClient, route: ModelRoute, decode: NodeState, node: NodeState | None,
                 prompt: list[int], request_id: str, fallbacks: list[str], *, ticket: Ticket | None = None,
                 rates: Rates | None = None, reroute: PrefillRoute | None = None) -> None:
        self._client, self._metrics = client, client.pool.metrics
        self._ticket, self._rates, self._reroute = ticket, rates, reroute  # admission to `node`; learned rates
        self.route, self.decode, self.node, self.prompt = route, decode, node, prompt
        self.request_id, self.fallbacks = request_id, fallbacks
        self.kv_start = 0  # leading prompt tokens whose KV the decode node already holds
        self.seconds: float | None = None  # wall time of the prefill call, set when it answered 200
        self.ms = 0.0  # wall time of the prefill call, whatever it answered
        self.t0: float | None = None  # when the call that answered 200 started (it took `seconds`)

    @property
    def tokens(self) -> int:
        """The KV range to push: prompt[kv_start:-1]."""
        return len(self.prompt) - 1 - self.kv_start

    async def run(self) -> None:
        """Prefill on `node`; one that could not start the work (unreachable, 503) hands over to another prefill node
        when the cost model still prefers waiting for one. When none succeeds, abort the transfer at once: the decode
        node then prefills locally."""
        t0, tried, node = time.monotonic(), [], self.node
        try:
            while node is not None:
                self.node = node
                failure, retry = await self._prefill_once(node)
                self.release()
                if failure is None:
                    return
                tried.append(node.name)
                self.fallbacks.append(Fallback.PREFILL_NODE_FAILED)
                self._metrics.fallback(self.route.id, Fallback.PREFILL_NODE_FAILED)
                node = await self._next_prefill(tried) if retry else None
                log.warning("prefill %s on %s failed (%s); %s", self.request_id, tried[-1], failure,
                            f"trying prefill node {node.name}" if node else "aborting the KV transfer")
            await self._client.abort_transfer(self.decode, self.request_id)
        finally:
            self.release()
            self.ms = (time.monotonic() - t0) * 1000.0

    async def _next_prefill(self, tried: list[str]) -> NodeState | None:
        """Another prefill node worth waiting for (admitted), or None: prefill locally."""
        if self._reroute is None:
            return self._client.pool.pick(self.route.prefill, exclude=tried)
        node = self._reroute.choose(tried)
        if node is None:
            return None
        try:
            self._ticket = await self._reroute.admit(node, self.tokens)
        except RateLimited:  # its queue is full too: local prefill now beats a 429 for a request already running
            return None
        return node

    def release(self) -> None:
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            ticket.release()

    async def _prefill_once(self, node: NodeState) -> tuple[str | None, bool]:
        """(failure or None, whether another node may retry). A retry is safe only when this node never started:
        no KV reached the decode node, whose transfer is still waiting untouched. A node that health checks mark down
        during the call fails it at once: its KV is not coming, and local prefill must not wait for a timeout."""
        node.inflight += 1
        call = asyncio.create_task(self._prefill_call(node))
        started = time.monotonic()
        try:
            while True:
                finished, _ = await asyncio.wait({call}, timeout=_DOWN_CHECK_S)
                if finished:
                    return call.result()
                why = self._stopped(node, started)
                if why is not None:
                    kind, failure = why
                    self._metrics.prefill_failures.labels(node.name, kind).inc()
                    return failure, False
        finally:
            node.inflight -= 1
            if not call.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await call

    def _stopped(self, node: NodeState, started: float) -> tuple[str, str] | None:
        """(kind, message) when a running prefill call's KV is not coming: its node was marked down, or it answered no
        call at all for `stall_s` beyond this prompt's own predicted time (live work ahead of it would have answered);
        None while it may still come."""
        if not node.up:
            return "node_down", f"prefill node {node.name} was marked down ({node.reason})"
        if self._reroute is None or self._rates is None:
            return None
        own = self.tokens / self._rates.prefill_rate(node.name).value
        last = self._rates.last_answer(node.name)
        quiet = time.monotonic() - max(started, last or started)
        if quiet > self._reroute.stall_s + own:
            return "stalled", f"prefill node {node.name} answered no prefill call for {quiet:.0f}s"
        return None

    async def _prefill_call(self, node: NodeState) -> tuple[str | None, bool]:
        payload = {
            "request_id": self.request_id, "model": self.route.id, "token_ids": self.prompt[:-1],
            # the prompt's last token: a prefill node running an EAGLE-3 head feeds it (not its own guess) to the
            # head's last prefilled position (docs/speculative.md, the prompt's drafter state)
            "next_token": self.prompt[-1], "kv_start": self.kv_start,
            "kv_target": self.decode.config.kv_target,
        }
        t0 = time.monotonic()
        failures = self._metrics.prefill_failures
        try:
            async with self._client.prefill(node, payload) as resp:
                if resp.status == 200:
                    await resp.read()
                    self.seconds = time.monotonic() - t0
                    self.t0 = t0
                    if self._rates is not None:
                        tokens = self.tokens
                        self._rates.prefill_call_done(node.name, tokens, t0, time.monotonic())
                    return None, False
                failure = f"HTTP {resp.status}: {await error_text(resp)}"
                failures.labels(node.name, "kv_not_delivered" if resp.status == 502 else "refused").inc()
                if resp.status == 503:
                    self._client.pool.mark(node, False, f"prefill call answered {failure}")
                return failure, resp.status == 503
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failure = f"{type(e).__name__}: {e}"
            unreachable = isinstance(e, aiohttp.ClientConnectorError)
            failures.labels(node.name, "unreachable" if unreachable else "broken").inc()
            if isinstance(e, aiohttp.ClientConnectionError):
                self._client.pool.mark(node, False, f"prefill call failed: {failure}")
            return failure, unreachable
