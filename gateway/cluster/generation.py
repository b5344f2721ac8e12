"""A generation on one decode node, per docs/protocol.md: open the decode stream (`accepted` says which prompt
prefix the node already holds, kv_start), then on the disaggregated path start its prefill call
(gateway/cluster/prefill.py: the KV of prompt[kv_start:-1], none when the node holds it all), read tokens, and learn
the rates from the done line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import AsyncIterator, Callable

import aiohttp

from kv_bridge.config.models import ModelRoute
from kv_bridge.protocol import DoneLine, Fallback, Path, ProtocolError, Sampling, TokenLine

from gateway.errors import InvalidRequest, NodeBusy, NodeUnavailable, UpstreamError
from gateway.cluster.node_client import NodeClient, error_text
from gateway.cluster.admission import Ticket
from gateway.cluster.nodes import Lease, NodeState
from gateway.cluster.prefill import PrefillCall, PrefillRoute
from gateway.cluster.rates import Rates

__all__ = ["Generation", "PrefillRoute"]

log = logging.getLogger("gateway.cluster.orchestrator")

# After decode's done line, wait this long for the prefill call to answer (for its timing) before cancelling it.
PREFILL_GRACE_S = 2.0
# A decode node answers `accepted` as soon as it parsed the request; one that does not within this is skipped.
_ACCEPT_TIMEOUT_S = 10.0
# Local prefills shorter than this say more about per-request overhead than about the node's prefill rate.
_MIN_LOCAL_SAMPLE = 32


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


class Generation:
    """A live generation on one decode node. Iterate `tokens()`; then `done` is set. Always `close()`, which
    releases the `lease` the orchestrator took for it."""

    def __init__(self, client: NodeClient, lease: Lease, route: ModelRoute, decode: NodeState,
                 prefill: NodeState | None, prompt: list[int], fallbacks: list[str] | None = None, *,
                 ticket: Ticket | None = None, rates: Rates | None = None,
                 reroute: PrefillRoute | None = None, predicted_ttft_s: float | None = None,
                 demote: Callable[[str, str, str, str], None] | None = None) -> None:
        self._client, self._lease, self._metrics = client, lease, client.pool.metrics
        self._rates = rates  # learned rates, fed from the done line
        self._demote = demote  # (model, prefill, decode, finding): a KV that failed the decode node's check
        self.route, self.decode, self.prompt = route, decode, prompt
        self.fallbacks = list(fallbacks or [])  # reasons, in the order they happened
        self.predicted_ttft_s = predicted_ttft_s  # the cost model's time to first token of the chosen path
        self.request_id = _new_request_id()
        self.kv_requested = prefill is not None
        self.kv_start = 0  # leading prompt tokens whose KV the decode node already holds (its `accepted` line)
        self.done: DoneLine | None = None
        self._prefill = PrefillCall(client, route, decode, prefill, prompt, self.request_id, self.fallbacks,
                                    ticket=ticket, rates=rates, reroute=reroute)
        self._first_at: float | None = None  # when the first token arrived (monotonic)
        self._resp: aiohttp.ClientResponse | None = None
        self._prefill_task: asyncio.Task | None = None
        self._closed = False

    @property
    def prefill(self) -> NodeState | None:
        """The prefill node asked (the last one, after a hand-over), or None on the local path."""
        return self._prefill.node

    @property
    def prefill_s(self) -> float | None:
        """Wall time of the prefill call, set when it answered 200."""
        return self._prefill.seconds

    @property
    def prefill_ms(self) -> float:
        """Wall time of the prefill call, whatever it answered."""
        return self._prefill.ms

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
            self.kv_start = self._prefill.kv_start = self._kv_start(first)
        if self.prefill is not None and self.kv_start < len(self.prompt) - 1:  # else decode holds all of it
            self._prefill_task = asyncio.create_task(self._prefill.run())

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
                    if self.done.fallback_reason == Fallback.KV_FIDELITY and self._demote and self.prefill:
                        self._demote(self.route.id, self.prefill.name, self.decode.name, self.done.kv_check or "")
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
            if self._prefill.t0 is not None and self.prefill_s is not None and self._first_at is not None:
                start = self._prefill.t0
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
        self._prefill.release()  # admitted but never (or not fully) run: the decode node refused, held it all, left
