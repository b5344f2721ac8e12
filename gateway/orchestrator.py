"""One generation across nodes, per docs/protocol.md: open the decode stream, then (disaggregated path) ask a
prefill node to push KV for prompt[:-1] to the decode node; abort the transfer if prefill fails. `Choices` runs
n such generations of one prompt concurrently (each picks the least-loaded decode node) and merges their streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import AsyncIterator

import aiohttp

from kv_bridge.config import ModelRoute, Settings

from .errors import InvalidRequest, NodeUnavailable, NoHealthyNode, UpstreamError
from .nodes import NodePool, NodeState

log = logging.getLogger("gateway.orchestrator")

DISAGGREGATED, LOCAL, FALLBACK = "disaggregated", "local", "fallback"
# After decode's done line, wait this long for the prefill call to answer (for its timing) before cancelling it.
PREFILL_GRACE_S = 2.0
_CONNECT_TIMEOUT_S = 5.0
_SEED_SPACE = 1 << 64  # seeds are unsigned 64-bit on the decode node


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
                 prompt: list[int]) -> None:
        self._orch = orch
        self.route, self.decode, self.prefill, self.prompt = route, decode, prefill, prompt
        self.request_id = _new_request_id()
        self.kv_requested = prefill is not None
        self.done: Done | None = None
        self.prefill_s: float | None = None  # wall time of the prefill call, set when it answered 200
        self.prefill_ms = 0.0  # wall time of the prefill call, whatever it answered
        self._resp: aiohttp.ClientResponse | None = None
        self._prefill_task: asyncio.Task | None = None
        self._closed = False
        decode.inflight += 1

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
        return DISAGGREGATED if d.kv_tokens > 0 else LOCAL

    def headers(self) -> dict[str, str]:
        d = self.done
        return {
            "x-disagg-path": self.path,
            "x-disagg-kv-tokens": str(d.kv_tokens if d else 0),
            "x-disagg-prefill-ms": f"{self.prefill_ms:.1f}" if self.prefill_ms else "0",
            "x-disagg-decode-node": self.decode.name,
        }

    async def open(self, sampling: Sampling) -> None:
        """POST /v1/generate and wait for `accepted`; then start the prefill call. Raises NodeUnavailable to fail over."""
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
        first = await self._next_line()
        if first is None or first.get("type") != "accepted":
            raise UpstreamError(f"decode node {self.decode.name} did not accept the request: {first!r}")
        if self.prefill is not None:
            self._prefill_task = asyncio.create_task(self._run_prefill(self.prefill))

    async def _reject(self, resp: aiohttp.ClientResponse) -> None:
        msg = await _error_text(resp)
        if resp.status == 503:
            raise NodeUnavailable(f"decode node {self.decode.name} is not ready: {msg}")
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

    async def _run_prefill(self, node: NodeState) -> None:
        payload = {
            "request_id": self.request_id, "model": self.route.id, "token_ids": self.prompt[:-1],
            "kv_target": {"host": self.decode.config.host, "port": self.decode.config.kv_port},
        }
        node.inflight += 1
        t0 = time.monotonic()
        failure = None
        try:
            async with self._orch.session.post(
                f"{node.url}/v1/prefill", json=payload, timeout=self._orch.stream_timeout
            ) as resp:
                if resp.status == 200:
                    await resp.read()
                    self.prefill_s = time.monotonic() - t0
                else:
                    failure = f"HTTP {resp.status}: {await _error_text(resp)}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failure = f"{type(e).__name__}: {e}"
            if isinstance(e, aiohttp.ClientConnectionError):
                self._orch.pool.mark(node, False, f"prefill call failed: {failure}")
        finally:
            node.inflight -= 1
            self.prefill_ms = (time.monotonic() - t0) * 1000.0
        if failure is not None:
            log.warning("prefill %s on %s failed (%s); aborting the KV transfer", self.request_id, node.name, failure)
            await self._orch.abort_transfer(self.decode, self.request_id)

    async def close(self) -> None:
        """Release the decode stream (closing it early tells the decode node to stop) and settle the prefill call."""
        if self._closed:
            return
        self._closed = True
        self.decode.inflight -= 1
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


class Orchestrator:
    def __init__(self, settings: Settings, session: aiohttp.ClientSession, pool: NodePool) -> None:
        self.session = session
        self.pool = pool
        self.stream_timeout = aiohttp.ClientTimeout(
            total=settings.gateway.request_timeout_s, sock_connect=_CONNECT_TIMEOUT_S
        )

    def choose_prefill(self, route: ModelRoute, prompt: list[int]) -> NodeState | None:
        """A prefill node when the path is worth disaggregating: one is healthy and the KV range is long enough."""
        if len(prompt) - 1 < route.min_disagg_tokens:
            return None
        return self.pool.pick(route.prefill)

    async def start(self, route: ModelRoute, prompt: list[int], sampling: Sampling) -> Generation:
        """Open a generation on the best decode node, failing over to the next when one is unreachable."""
        tried: list[str] = []
        while True:
            decode = self.pool.pick(route.decode, exclude=tried)
            if decode is None:
                detail = f" (tried {', '.join(tried)})" if tried else ""
                raise NoHealthyNode(f"no healthy decode node for model {route.id!r}{detail}; retry later")
            gen = Generation(self, route, decode, self.choose_prefill(route, prompt), prompt)
            try:
                await gen.open(sampling)
                return gen
            except NodeUnavailable as e:
                self.pool.mark(decode, False, e.message)
                tried.append(decode.name)
                await gen.close()
            except BaseException:
                await gen.close()
                raise

    async def abort_transfer(self, decode: NodeState, request_id: str) -> None:
        url = f"{decode.url}/v1/transfers/{request_id}/abort"
        try:
            async with self.session.post(url, timeout=aiohttp.ClientTimeout(total=_CONNECT_TIMEOUT_S)) as resp:
                await resp.read()
                if resp.status != 200:
                    log.warning("abort of %s on %s answered HTTP %s", request_id, decode.name, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("abort of %s on %s failed: %s", request_id, decode.name, e)


def per_choice(sampling: Sampling, n: int) -> list[Sampling]:
    """One Sampling per choice. A seed is offset by the choice index (as vLLM does), so a seeded n=2 request
    gives two different, reproducible choices rather than two copies."""
    if sampling.seed is None:
        return [replace(sampling) for _ in range(n)]
    return [replace(sampling, seed=(sampling.seed + i) % _SEED_SPACE) for i in range(n)]


class Choices:
    """Start with `start()`, iterate `events()`: (index, Token) per token, (index, None) when choice `index`
    is done (its `done` line is then in `dones[index]`). Always `close()`."""

    def __init__(self, orch: Orchestrator, route: ModelRoute, prompt: list[int], samplings: list[Sampling]) -> None:
        self._orch, self.route, self.prompt, self.samplings = orch, route, prompt, samplings
        self.gens: list[Generation] = []
        self._pumps: list[asyncio.Task] = []
        self._closed = False

    @property
    def n(self) -> int:
        return len(self.samplings)

    async def start(self) -> None:
        """Open every generation; if any cannot start, close the others and raise its error."""
        results = await asyncio.gather(
            *(self._orch.start(self.route, self.prompt, s) for s in self.samplings), return_exceptions=True
        )
        self.gens = [r for r in results if isinstance(r, Generation)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]

    @property
    def first(self) -> Generation:
        return self.gens[0]

    @property
    def dones(self) -> list[Done | None]:
        return [g.done for g in self.gens]

    async def events(self) -> AsyncIterator[tuple[int, Token | None]]:
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
    async def _pump(index: int, gen: Generation, q: asyncio.Queue) -> None:
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
