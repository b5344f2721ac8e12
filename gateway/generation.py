"""A generation on one decode node, per docs/protocol.md: open the decode stream (`accepted` says which prompt
prefix the node already holds, kv_start), then on the disaggregated path ask a prefill node to push the KV of
prompt[kv_start:-1] (none when the node holds it all); another prefill node when one cannot be reached
(prefill_node_failed); abort the transfer when none can, and the decode node prefills locally (path "fallback").
The wire-level types the handlers share (Sampling, Token, Done) live here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

import aiohttp

from kv_bridge.config import ModelRoute

from .errors import InvalidRequest, NodeBusy, NodeUnavailable, UpstreamError
from .nodes import NodeState

if TYPE_CHECKING:
    from .orchestrator import Orchestrator

log = logging.getLogger("gateway.orchestrator")

DISAGGREGATED, LOCAL, FALLBACK = "disaggregated", "local", "fallback"
DECODE_NODE_FAILED, PREFILL_NODE_FAILED, NO_CAPACITY = "decode_node_failed", "prefill_node_failed", "no_capacity"
DECODE_NODE_BUSY, DECODE_FAILOVER = "decode_node_busy", "decode_failover"
# After decode's done line, wait this long for the prefill call to answer (for its timing) before cancelling it.
PREFILL_GRACE_S = 2.0
CONNECT_TIMEOUT_S = 5.0
# A decode node answers `accepted` as soon as it parsed the request; one that does not within this is skipped.
_ACCEPT_TIMEOUT_S = 10.0


@dataclass
class Sampling:
    """What the decode node samples with; `payload()` is the sampling part of the /v1/generate body."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] = field(default_factory=dict)  # token id (decimal string) -> additive bias
    logprobs: int | None = None  # alternatives per token to report; None: no logprobs at all

    def payload(self) -> dict:
        return asdict(self)


@dataclass
class Token:
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # best first


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    kv_tokens: int
    fallback_reason: str | None
    kv_transfer_s: float
    kv_bytes: int
    prefix_tokens: int = 0  # prompt tokens whose KV the decode node reused from an earlier request

    @classmethod
    def from_line(cls, msg: dict) -> "Done":
        try:
            return cls(
                finish_reason=str(msg.get("finish_reason") or "stop"),
                prompt_tokens=int(msg.get("prompt_tokens") or 0),
                completion_tokens=int(msg.get("completion_tokens") or 0),
                kv_tokens=int(msg.get("kv_tokens") or 0),
                fallback_reason=msg.get("fallback_reason") or None,
                kv_transfer_s=float(msg.get("kv_transfer_s") or 0.0),
                kv_bytes=int(msg.get("kv_bytes") or 0),
                prefix_tokens=int(msg.get("prefix_tokens") or 0),
            )
        except (TypeError, ValueError):
            raise UpstreamError(f"decode node sent a malformed done line: {msg!r}") from None


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


async def _error_text(resp: aiohttp.ClientResponse) -> str:
    """A node's error message from `{"error": {"message": ...}}`, or its raw body."""
    raw = await resp.text(errors="replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return str(json.loads(raw)["error"]["message"])
    return raw[:500] or f"HTTP {resp.status}"


class Generation:
    """A live generation on one decode node. Iterate `tokens()`; then `done` is set. Always `close()`."""

    def __init__(self, orch: "Orchestrator", route: ModelRoute, decode: NodeState, prefill: NodeState | None,
                 prompt: list[int], prefix: list[bytes] | None = None, fallbacks: list[str] | None = None) -> None:
        self._orch = orch
        self.route, self.decode, self.prefill, self.prompt = route, decode, prefill, prompt
        self.prefix = prefix or []  # affinity hashes of the prompt, remembered when the generation finishes
        self.fallbacks = list(fallbacks or [])  # reasons, in the order they happened
        self.request_id = _new_request_id()
        self.kv_requested = prefill is not None
        self.kv_start = 0  # leading prompt tokens whose KV the decode node already holds (its `accepted` line)
        self.done: Done | None = None
        self.prefill_s: float | None = None  # wall time of the prefill call, set when it answered 200
        self.prefill_ms = 0.0  # wall time of the prefill call, whatever it answered
        self._resp: aiohttp.ClientResponse | None = None
        self._prefill_task: asyncio.Task | None = None
        self._closed = False
        decode.inflight += 1
        orch.admitted(route, +1)

    @property
    def planned_path(self) -> str:
        return DISAGGREGATED if self.kv_requested else LOCAL

    @property
    def path(self) -> str:
        """The path this request actually took, known once `done` arrived."""
        d = self.done
        if not self.kv_requested or d is None:
            return self.planned_path
        if d.fallback_reason:
            return FALLBACK
        return DISAGGREGATED if d.kv_tokens > 0 or d.prefix_tokens > 0 else LOCAL

    def headers(self) -> dict[str, str]:
        d = self.done
        out = {
            "x-disagg-path": self.path,
            "x-disagg-kv-tokens": str(d.kv_tokens if d else 0),
            "x-disagg-prefix-tokens": str(d.prefix_tokens if d else 0),
            "x-disagg-prefill-ms": f"{self.prefill_ms:.1f}" if self.prefill_ms else "0",
            "x-disagg-decode-node": self.decode.name,
        }
        if self.fallbacks:
            out["x-disagg-fallbacks"] = ",".join(self.fallbacks)
        return out

    async def open(self, sampling: Sampling) -> None:
        """POST /v1/generate and wait for `accepted`; then start the prefill call. Raises NodeUnavailable (node down)
        or UpstreamError (node failed before its stream started) to fail over, InvalidRequest for a 4xx."""
        payload = {
            "request_id": self.request_id, "model": self.route.id, "token_ids": self.prompt, **sampling.payload(),
            "kv": {"tokens": len(self.prompt) - 1} if self.kv_requested else None,
        }
        url = f"{self.decode.url}/v1/generate"
        try:
            self._resp = await self._orch.session.post(url, json=payload, timeout=self._orch.stream_timeout)
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
        msg = await _error_text(resp)
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

    async def tokens(self) -> AsyncIterator[Token]:
        while True:
            msg = await self._next_line()
            if msg is None:
                raise UpstreamError(f"decode node {self.decode.name} ended the stream without a done line")
            kind = msg.get("type")
            if kind == "token":
                yield self._token(msg)
            elif kind == "done":
                self.done = Done.from_line(msg)
                if self.done.fallback_reason:
                    self.fallbacks.append(self.done.fallback_reason)
                    self._orch.metrics.fallback(self.route.id, self.done.fallback_reason)
                return
            elif kind == "error":
                raise UpstreamError(f"decode node {self.decode.name} failed: {msg.get('message')}")
            # Unknown line types are skipped so nodes can add fields without breaking older gateways.

    def _token(self, msg: dict) -> Token:
        try:
            lp, top = msg.get("logprob"), msg.get("top_logprobs")
            return Token(int(msg["token_id"]), str(msg.get("text") or ""), None if lp is None else float(lp),
                         None if top is None else [(int(t), float(v)) for t, v in top])
        except (KeyError, TypeError, ValueError):
            raise UpstreamError(f"decode node {self.decode.name} sent a malformed token line: {msg!r}") from None

    async def _run_prefill(self, node: NodeState | None) -> None:
        """Prefill on `node`; one that could not start the work (unreachable, 503) hands over to another prefill node
        of the pool. When none succeeds, abort the transfer: the decode node then prefills locally."""
        t0, tried = time.monotonic(), []
        try:
            while node is not None:
                self.prefill = node
                failure, retry = await self._prefill_once(node)
                if failure is None:
                    return
                tried.append(node.name)
                self.fallbacks.append(PREFILL_NODE_FAILED)
                self._orch.metrics.fallback(self.route.id, PREFILL_NODE_FAILED)
                node = self._orch.pool.pick(self.route.prefill, exclude=tried) if retry else None
                log.warning("prefill %s on %s failed (%s); %s", self.request_id, tried[-1], failure,
                            f"trying prefill node {node.name}" if node else "aborting the KV transfer")
            await self._orch.abort_transfer(self.decode, self.request_id)
        finally:
            self.prefill_ms = (time.monotonic() - t0) * 1000.0

    async def _prefill_once(self, node: NodeState) -> tuple[str | None, bool]:
        """(failure or None, whether another node may retry). A retry is safe only when this node never started:
        no KV reached the decode node, whose transfer is still waiting untouched."""
        payload = {
            "request_id": self.request_id, "model": self.route.id, "token_ids": self.prompt[:-1],
            "kv_start": self.kv_start,
            "kv_target": self.decode.config.kv_target,
        }
        node.inflight += 1
        t0 = time.monotonic()
        try:
            async with self._orch.session.post(
                f"{node.url}/v1/prefill", json=payload, timeout=self._orch.stream_timeout
            ) as resp:
                if resp.status == 200:
                    await resp.read()
                    self.prefill_s = time.monotonic() - t0
                    return None, False
                failure = f"HTTP {resp.status}: {await _error_text(resp)}"
                if resp.status == 503:
                    self._orch.pool.mark(node, False, f"prefill call answered {failure}")
                return failure, resp.status == 503
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failure = f"{type(e).__name__}: {e}"
            if isinstance(e, aiohttp.ClientConnectionError):
                self._orch.pool.mark(node, False, f"prefill call failed: {failure}")
            return failure, isinstance(e, aiohttp.ClientConnectorError)
        finally:
            node.inflight -= 1

    async def close(self) -> None:
        """Release the decode stream (closing it early tells the decode node to stop) and settle the prefill call."""
        if self._closed:
            return
        self._closed = True
        self.decode.inflight -= 1
        self._orch.admitted(self.route, -1)
        if self.done is not None:
            self._orch.affinity.remember(self.prefix, self.decode.name)
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
