"""A generation on one decode node, per docs/protocol.md: open the decode stream (`accepted` says which prompt
prefix the node already holds, kv_start), then on the disaggregated path ask a prefill node to push the KV of
prompt[kv_start:-1] (none when the node holds it all); another prefill node when one cannot be reached
(prefill_node_failed); abort the transfer when none can, and the decode node prefills locally (path "fallback").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable

import aiohttp

from kv_bridge.config import ModelRoute
from kv_bridge.protocol import DoneLine, Fallback, Path, ProtocolError, Sampling, TokenLine

from gateway.errors import InvalidRequest, NodeBusy, NodeUnavailable, RateLimited, UpstreamError
from gateway.cluster.node_client import NodeClient, error_text
from gateway.cluster.admission import Ticket
from gateway.cluster.nodes import Lease, NodeState
from gateway.cluster.rates import Rates

log = logging.getLogger("gateway.cluster.orchestrator")

# After decode's done line, wait this long for the prefill call to answer (for its timing) before cancelling it.
PREFILL_GRACE_S = 2.0
# A decode node answers `accepted` as soon as it parsed the request; one that does not within this is skipped.
_ACCEPT_TIMEOUT_S = 10.0
# While a prefill call runs, how often to look whether health checks marked its node down (then abort at once).
_DOWN_CHECK_S = 0.5
# Local prefills shorter than this say more about per-request overhead than about the node's prefill rate.
_MIN_LOCAL_SAMPLE = 32


class PrefillRoute:
    """What a generation needs to find and enter a prefill node, as values: `choose(exclude)` the node worth waiting
    for (cost model) or None, `admit(node, tokens)` its admission ticket (may queue; RateLimited past the queue)."""

    def __init__(self, choose: Callable[[list[str]], NodeState | None],
                 admit: Callable[[NodeState, int], Awaitable[Ticket]], stall_s: float = float("inf")) -> None:
        self.choose, self.admit, self.stall_s = choose, admit, stall_s


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


class Generation:
    """A live generation on one decode node. Iterate `tokens()`; then `done` is set. Always `close()`, which
    releases the `lease` the orchestrator took for it."""

    def __init__(self, client: NodeClient, lease: Lease, route: ModelRoute, decode: NodeState,
                 prefill: NodeState | None, prompt: list[int], fallbacks: list[str] | None = None, *,
                 ticket: Ticket | None = None, rates: Rates | None = None,
                 reroute: PrefillRoute | None = None, predicted_ttft_s: float | None = None) -> None:
        self._client, self._lease, self._metrics = client, lease, client.pool.metrics
        self._ticket, self._rates, self._reroute = ticket, rates, reroute  # admission to `prefill`; learned rates
        self.route, self.decode, self.prefill, self.prompt = route, decode, prefill, prompt
        self.fallbacks = list(fallbacks or [])  # reasons, in the order they happened
        self.predicted_ttft_s = predicted_ttft_s  # the cost model's time to first token of the chosen path
        self.request_id = _new_request_id()
        self.kv_requested = prefill is not None
        self.kv_start = 0  # leading prompt tokens whose KV the decode node already holds (its `accepted` line)
        self.done: DoneLine | None = None
        self.prefill_s: float | None = None  # wall time of the prefill call, set when it answered 200
        self.prefill_ms = 0.0  # wall time of the prefill call, whatever it answered
        self._prefill_t0: float | None = None  # when the call that answered 200 started (it took prefill_s)
        self._first_at: float | None = None  # when the first token arrived (monotonic)
        self._resp: aiohttp.ClientResponse | None = None
        self._prefill_task: asyncio.Task | None = None
        self._closed = False

    @property
    def planned_path(self) -> Path:
        return Path.DISAGGREGATED if self.kv_requested else Path.LOCAL

    @property
    def path(self) -> Path:
        """The path this request actually took, known once `done` arrived."""
        d = self.done
        if not self.kv_requested or d is None:
            return self.planned_path
        if d.fallback_reason:
            return Path.FALLBACK
        return Path.DISAGGREGATED if d.kv_tokens > 0 or d.prefix_tokens > 0 else Path.LOCAL

    def headers(self) -> dict[str, str]:
        d = self.done
        out = {
            "x-disagg-path": str(self.path),
            "x-disagg-kv-tokens": str(d.kv_tokens if d else 0),
            "x-disagg-prefix-tokens": str(d.prefix_tokens if d else 0),
            "x-disagg-prefill-ms": f"{self.prefill_ms:.1f}" if self.prefill_ms else "0",
            "x-disagg-decode-node": self.decode.name,
        }
        if self.fallbacks:
            out["x-disagg-fallbacks"] = ",".join(self.fallbacks)
        if self.predicted_ttft_s is not None:
            out["x-disagg-predicted-ttft-ms"] = f"{self.predicted_ttft_s * 1000.0:.1f}"
        return out

    async def open(self, sampling: Sampling) -> None:
        """POST /v1/generate and wait for `accepted`; then start the prefill call. Raises NodeUnavailable (node down)
        or UpstreamError (node failed before its stream started) to fail over, InvalidRequest for a 4xx."""
        payload = {
            "request_id": self.request_id, "model": self.route.id, "token_ids": self.prompt, **sampling.to_json(),
            "kv": {"tokens": len(self.prompt) - 1} if self.kv_requested else None,
        }
        try:
            self._resp = await self._client.open_generate(self.decode, payload)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise NodeUnavailable(f"decode node {self.decode.name} unreachable: {type(e).__name__}: {e}") from None
        if self._resp.status != 200:
            await self._reject(self._resp)
        try:
            first = await asyncio.wait_for(self._next_line(), _ACCEPT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise UpstreamError(f"decode node {self.decode.name} did not accept within {_ACCEPT_TIMEOUT_S:.0f}s") from None
        if first is None or first.get("type") != "accepted":
            raise UpstreamError(f"decode node {self.decode.name} did not accept the request: {first!r}")
        if self.kv_requested:
            self.kv_start = self._kv_start(first)
        if self.prefill is not None and self.kv_start < len(self.prompt) - 1:  # else decode holds all of it
            self._prefill_task = asyncio.create_task(self._run_prefill(self.prefill))

    def _kv_start(self, accepted: dict) -> int:
        """The decode node's `kv_start`: 0 (absent, an older node) up to the whole KV range, prompt[:-1]."""
        p = accepted.get("kv_start", 0)
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p <= len(self.prompt) - 1:
            raise UpstreamError(f"decode node {self.decode.name} sent kv_start {p!r} outside "
                                f"[0, {len(self.prompt) - 1}]")
        return p

    async def _reject(self, resp: aiohttp.ClientResponse) -> None:
        msg = await error_text(resp)
        if resp.status == 503:
            raise NodeUnavailable(f"decode node {self.decode.name} is not ready: {msg}")
        if resp.status == 429:
            raise NodeBusy(f"decode node {self.decode.name} is busy: {msg}")
        if 400 <= resp.status < 500:
            raise InvalidRequest(f"decode node {self.decode.name} refused the request: {msg}")
        raise UpstreamError(f"decode node {self.decode.name} answered HTTP {resp.status}: {msg}")

    async def _next_line(self) -> dict | None:
        """The next NDJSON object from the decode stream, or None at end of stream."""
        assert self._resp is not None
        while True:
            try:
                raw = await self._resp.content.readline()
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                raise UpstreamError(f"decode node {self.decode.name} stream broke: {type(e).__name__}: {e}") from None
            if not raw:
                return None
            if not raw.strip():
                continue
            try:
                msg = json.loads(raw)
            except ValueError:
                msg = None
            if not isinstance(msg, dict):
                raise UpstreamError(f"decode node {self.decode.name} sent a malformed line: {raw[:200]!r}")
            return msg

    async def tokens(self) -> AsyncIterator[TokenLine]:
        while True:
            msg = await self._next_line()
            if msg is None:
                raise UpstreamError(f"decode node {self.decode.name} ended the stream without a done line")
            kind = msg.get("type")
            if kind == "token":
                if self._first_at is None:
                    self._first_at = time.monotonic()
                yield self._parse(TokenLine, msg)
            elif kind == "done":
                self.done = self._parse(DoneLine, msg)
                self._learn(self.done)
                if self.done.fallback_reason:
                    self.fallbacks.append(self.done.fallback_reason)
                    self._metrics.fallback(self.route.id, self.done.fallback_reason)
                return
            elif kind == "error":
                raise UpstreamError(f"decode node {self.decode.name} failed: {msg.get('message')}")
            # Unknown line types are skipped so nodes can add fields without breaking older gateways.

    def _learn(self, d: DoneLine) -> None:
        """The done line's timings feed the learned rates: link bytes/s and KV size from a transfer, the decode
        node's local prefill tokens/s from a prompt it computed itself."""
        log.debug("%s on %s: %d prompt tokens (%d KV, %d computed), predicted TTFT %.3fs; prefill call %.3fs, "
                  "KV %.3fs (link %.3fs, %d B), decode TTFT %.3fs", self.request_id, self.decode.name,
                  d.prompt_tokens, d.kv_tokens, d.computed_tokens, self.predicted_ttft_s or 0.0, self.prefill_s or 0.0,
                  d.kv_transfer_s, d.kv_link_s, d.kv_bytes, d.ttft_s)
        if self._rates is None:
            return
        if d.kv_tokens > 0 and d.kv_bytes > 0:
            self._rates.observe_kv_size(self.route.id, d.kv_tokens, d.kv_bytes)
            if self.prefill is not None:
                self._rates.observe_link(self.prefill.name, self.decode.name, d.kv_bytes, d.kv_link_s)
            if self._prefill_t0 is not None and self.prefill_s is not None and self._first_at is not None:
                start = self._prefill_t0
                landed = start + max(self.prefill_s, d.kv_link_s)
                self._rates.observe_ingest(self.decode.name, d.kv_tokens, self._first_at - landed, self.route.id)
        elif d.computed_tokens >= _MIN_LOCAL_SAMPLE and d.ttft_s > 0:
            self._rates.observe_local(self.decode.name, d.computed_tokens, d.ttft_s, self.route.id)

    def _parse(self, kind, msg: dict):
        """A protocol line (TokenLine or DoneLine); a malformed one fails the stream like a broken node."""
        try:
            return kind.from_json(msg)
        except ProtocolError as e:
            raise UpstreamError(f"decode node {self.decode.name} sent a {e}") from None

    async def _run_prefill(self, node: NodeState | None) -> None:
        """Prefill on `node`; one that could not start the work (unreachable, 503) hands over to another prefill node
        when the cost model still prefers waiting for one. When none succeeds, abort the transfer at once: the decode
        node then prefills locally."""
        t0, tried = time.monotonic(), []
        try:
            while node is not None:
                self.prefill = node
                failure, retry = await self._prefill_once(node)
                self._release_ticket()
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
            self._release_ticket()
            self.prefill_ms = (time.monotonic() - t0) * 1000.0

    async def _next_prefill(self, tried: list[str]) -> NodeState | None:
        """Another prefill node worth waiting for (admitted), or None: prefill locally."""
        if self._reroute is None:
            return self._client.pool.pick(self.route.prefill, exclude=tried)
        node = self._reroute.choose(tried)
        if node is None:
            return None
        try:
            self._ticket = await self._reroute.admit(node, len(self.prompt) - 1 - self.kv_start)
        except RateLimited:  # its queue is full too: local prefill now beats a 429 for a request already running
            return None
        return node

    def _release_ticket(self) -> None:
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
        own = (len(self.prompt) - 1 - self.kv_start) / self._rates.prefill_rate(node.name).value
        last = self._rates.last_answer(node.name)
        quiet = time.monotonic() - max(started, last or started)
        if quiet > self._reroute.stall_s + own:
            return "stalled", f"prefill node {node.name} answered no prefill call for {quiet:.0f}s"
        return None

    async def _prefill_call(self, node: NodeState) -> tuple[str | None, bool]:
        payload = {
            "request_id": self.request_id, "model": self.route.id, "token_ids": self.prompt[:-1],
            "kv_start": self.kv_start,
            "kv_target": self.decode.config.kv_target,
        }
        t0 = time.monotonic()
        failures = self._metrics.prefill_failures
        try:
            async with self._client.prefill(node, payload) as resp:
                if resp.status == 200:
                    await resp.read()
                    self.prefill_s = time.monotonic() - t0
                    self._prefill_t0 = t0
                    if self._rates is not None:
                        tokens = len(self.prompt) - 1 - self.kv_start
                        self._rates.prefill_call_done(node.name, tokens, t0, time.monotonic())
                    return None, False
                failure = f"HTTP {resp.status}: {await error_text(resp)}"
                failures.labels(node.name, "refused").inc()
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

    async def close(self) -> None:
        """Release the decode stream (closing it early tells the decode node to stop) and settle the prefill call."""
        if self._closed:
            return
        self._closed = True
        self._lease.release(finished=self.done is not None)
        if self._resp is not None:
            # A finished stream can go back to the pool; an unfinished one must drop its connection.
            if self.done is not None:
                self._resp.release()
            else:
                self._resp.close()
        task = self._prefill_task
        if task is not None and not task.done():
            # Only a finished generation is worth waiting for; an abandoned one cancels its prefill right away.
            if self.done is not None:
                await asyncio.wait({task}, timeout=PREFILL_GRACE_S)
            task.cancel()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._release_ticket()  # admitted but never (or not fully) run: the decode node refused, held it all, left
