"""One generation across nodes, per docs/protocol.md: open the decode stream, then (disaggregated path) ask a
prefill node to push KV for prompt[kv_start:-1] to the decode node (which holds the KV of the first kv_start
tokens already; none to push when that is all of them); abort the transfer if prefill fails. `Choices` runs
n such generations of one prompt concurrently and merges their streams.

Fallbacks, in order, each counted in disagg_fallbacks_total{reason} and listed in x-disagg-fallbacks: another
decode node when one refuses or fails before its stream starts (decode_node_failed), or when its stream breaks
after that (decode_failover: `Resumable` continues the same stream there); another prefill node when one
cannot be reached (prefill_node_failed); decode-local prefill when the KV does not arrive (kv_timeout, kv_error,
kv_aborted: path "fallback"); the model's configured upstream through litellm (upstream: path "upstream"); then 429
when the pool is only full, else 503 (no_capacity).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import AsyncIterator, Callable

import aiohttp

from kv_bridge.config import ModelRoute, Settings
from kv_bridge.stops import StopMatcher

from .errors import InvalidRequest, NodeBusy, NodeUnavailable, NoHealthyNode, RateLimited, UpstreamError
from .nodes import NodePool, NodeState, PrefixAffinity
from .upstream import UPSTREAM, UpstreamGeneration, check_upstreams, current_input

log = logging.getLogger("gateway.orchestrator")

DISAGGREGATED, LOCAL, FALLBACK = "disaggregated", "local", "fallback"
DECODE_NODE_FAILED, PREFILL_NODE_FAILED, NO_CAPACITY = "decode_node_failed", "prefill_node_failed", "no_capacity"
DECODE_NODE_BUSY, DECODE_FAILOVER = "decode_node_busy", "decode_failover"
# After decode's done line, wait this long for the prefill call to answer (for its timing) before cancelling it.
PREFILL_GRACE_S = 2.0
_CONNECT_TIMEOUT_S = 5.0
# A decode node answers `accepted` as soon as it parsed the request; one that does not within this is skipped.
_ACCEPT_TIMEOUT_S = 10.0
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


class Resumable:
    """A decode generation that outlives its node: when the stream breaks after `accepted` (connection reset, end
    of stream without a done line, an error line), the same client stream goes on on another healthy decode node of
    the pool (decode_failover). The new generation's prompt is the client's prompt plus every token generated so
    far, its max_tokens what is left, its sampling the same; so a greedy stream reads exactly as an uninterrupted one.

    Stop strings: text the broken node held back (the start of a possible stop string, an incomplete character) is
    recomputed here from the token ids, and from then on the gateway matches the stop strings itself (the node's own
    StopMatcher, over the same text, one token behind) while the new node runs without them, so a stop string
    spanning the break is caught where an uninterrupted run would have caught it. With no other node the original
    error is raised: the client gets today's error event. Same interface as Generation."""

    def __init__(self, orch: "Orchestrator", gen: Generation, sampling: Sampling) -> None:
        self._orch, self.gen, self.sampling = orch, gen, sampling
        self.prompt = gen.prompt  # the client's prompt; usage counts it, not a continuation's longer one
        self.ids: list[int] = []  # every token received, across nodes
        self.done: Done | None = None
        self.failovers = 0
        self._text = ""  # the text handed to the consumer (or waiting in `_pending`) so far
        self._carry = ""  # text the broken node held back, prepended to the next token's
        self._stops: StopMatcher | None = None  # the gateway's stop matching, after a failover with stop strings
        self._pending: Token | None = None  # with `_stops`: the newest token, held until the next shows it final
        self._tried = [gen.decode.name]

    @property
    def route(self) -> ModelRoute:
        return self.gen.route

    @property
    def decode(self) -> NodeState:
        return self.gen.decode

    @property
    def request_id(self) -> str:
        return self.gen.request_id

    @property
    def planned_path(self) -> str:
        return self.gen.planned_path

    @property
    def path(self) -> str:
        return self.gen.path

    @property
    def prefill_s(self) -> float | None:
        return self.gen.prefill_s

    @property
    def fallbacks(self) -> list[str]:
        return self.gen.fallbacks

    def headers(self) -> dict[str, str]:
        return self.gen.headers()

    async def close(self) -> None:
        await self.gen.close()

    async def tokens(self) -> AsyncIterator[Token]:
        stopped = False
        while not stopped:
            try:
                async for tok in self.gen.tokens():
                    tok, stopped = self._receive(tok)
                    if self._stops is None:
                        yield tok
                        continue
                    if self._pending is not None:
                        yield self._pending
                    self._pending = tok
                    if stopped:
                        break
                break
            except UpstreamError as e:
                await self._close_broken()
                if len(self.ids) >= self.sampling.max_tokens:
                    break  # it broke after its last token: nothing is missing
                if not await self._resume(e):
                    raise
        if self._pending is not None:
            if not stopped:
                self._pending.text += self._stops.flush()
            tok, self._pending = self._pending, None
            yield tok
        self.done = self._final_done(stopped)

    def _receive(self, tok: Token) -> tuple[Token, bool]:
        """The token as the client sees it, and whether the gateway's stop matching ended the generation."""
        self.ids.append(tok.token_id)
        text, hit = self._carry + tok.text, False
        self._carry = ""
        if self._stops is not None:
            text, hit = self._stops.feed(text)
        tok.text = text
        self._text += text
        return tok, hit

    def _final_done(self, stopped: bool) -> Done:
        """The done line the client's request gets: its own prompt and every token generated for it."""
        if stopped or self.gen.done is None:  # the gateway hit a stop string, or there was nothing left to generate
            return Done("stop" if stopped else "length", len(self.prompt), len(self.ids), 0, None, 0.0, 0)
        if not self.failovers:
            return self.gen.done
        return replace(self.gen.done, prompt_tokens=len(self.prompt), completion_tokens=len(self.ids))

    async def _close_broken(self) -> None:
        """Drop the broken stream; a dead node is marked down now rather than at the next health poll."""
        await self.gen.close()
        await self._orch.pool.check(self._orch.session, self.gen.decode)

    async def _resume(self, err: UpstreamError) -> bool:
        """Continue on another decode node of the pool; False when none can (the caller then raises `err`)."""
        orch, broken = self._orch, self.gen
        self._carry = self._held_text()
        stops = self.sampling.stop
        sampling = replace(self.sampling, max_tokens=self.sampling.max_tokens - len(self.ids), stop=[])
        prompt = [*self.prompt, *self.ids]
        fallbacks = [*broken.fallbacks, DECODE_FAILOVER]
        gen = await orch.open_on_pool(self.route, prompt, sampling, self._tried, fallbacks,
                                      orch.affinity.hashes(self.route.id, prompt))
        if gen is None:
            log.warning("decode node %s broke mid-stream (%s) and no other decode node can continue %s",
                        broken.decode.name, err.message, broken.request_id)
            return False
        log.warning("decode node %s broke mid-stream after %d tokens (%s); %s continues on %s as %s",
                    broken.decode.name, len(self.ids), err.message, broken.request_id, gen.decode.name,
                    gen.request_id)
        orch.metrics.fallback(self.route.id, DECODE_FAILOVER)
        self._tried.append(gen.decode.name)
        if stops:  # a fresh matcher: what the old one held is in `_carry` now
            self._stops = StopMatcher(stops)
        self.gen, self.failovers = gen, self.failovers + 1
        return True

    def _held_text(self) -> str:
        """The text of the tokens received that the broken node never sent (the detokenizer's incomplete character,
        the StopMatcher's tail): the full decode of the ids, less what the consumer already has."""
        full = self._orch.detokenize(self.route.id, self.ids)
        if full is None or not full.startswith(self._text):
            if full is not None:
                log.warning("%s: the decoded tokens do not extend the streamed text; dropping the held-back text",
                            self.request_id)
            return ""
        return full[len(self._text):]


class Orchestrator:
    def __init__(self, settings: Settings, session: aiohttp.ClientSession, pool: NodePool,
                 detokenize: Callable[[str, list[int]], str] | None = None) -> None:
        check_upstreams(settings.models)
        # (model id, token ids) -> text; a mid-stream failover recomputes the text the broken node held back with it.
        self._detokenize = detokenize
        self.session = session
        self.pool = pool
        self.metrics = pool.metrics
        self.metrics.declare(m.id for m in settings.models)
        self.stream_timeout = aiohttp.ClientTimeout(
            total=settings.gateway.request_timeout_s, sock_connect=_CONNECT_TIMEOUT_S
        )
        gw = settings.gateway
        self.retry_after_s, self.affinity_slack = gw.retry_after_s, gw.affinity_slack
        self.affinity = PrefixAffinity(gw.affinity_entries, gw.affinity_block_tokens)
        self.inflight: dict[str, int] = {}  # generations per model, decode and upstream alike

    def detokenize(self, model_id: str, ids: list[int]) -> str | None:
        return None if self._detokenize is None else self._detokenize(model_id, ids)

    def admitted(self, route: ModelRoute, delta: int) -> None:
        self.inflight[route.id] = self.inflight.get(route.id, 0) + delta

    def choose_prefill(self, route: ModelRoute, prompt: list[int]) -> NodeState | None:
        """A prefill node when the path is worth disaggregating: one is available and the KV range is long enough."""
        if len(prompt) - 1 < route.min_disagg_tokens:
            return None
        return self.pool.pick(route.prefill)

    async def start(self, route: ModelRoute, prompt: list[int], sampling: Sampling) -> Generation | UpstreamGeneration:
        """Open a generation: the conversation's decode node or the least-loaded one, then the next on failure, then
        the upstream; 429 at the model's limit or when every node is full, 503 when nothing can serve."""
        limit = route.max_inflight
        if limit is not None and self.inflight.get(route.id, 0) >= limit:
            self.metrics.fallback(route.id, NO_CAPACITY)
            raise RateLimited(f"model {route.id!r} has {limit} generations in flight (its max_inflight); retry in "
                              f"{self.retry_after_s}s", self.retry_after_s)
        prefix = self.affinity.hashes(route.id, prompt)
        prefer = self._remembered(route, prefix)
        tried: list[str] = []
        busy: list[str] = []
        fallbacks: list[str] = []
        gen = await self.open_on_pool(route, prompt, sampling, tried, fallbacks, prefix, prefer, busy)
        if gen is None:
            return await self._beyond_the_pool(route, prompt, sampling, tried, fallbacks, busy)
        return Resumable(self, gen, sampling)

    async def open_on_pool(self, route: ModelRoute, prompt: list[int], sampling: Sampling, tried: list[str],
                           fallbacks: list[str], prefix: list[bytes], prefer: str | None = None,
                           busy: list[str] | None = None) -> Generation | None:
        """A generation opened on the first decode node of the pool that accepts it (skipping `tried`, to which
        each node that fails is added; one that answered 429 goes to `busy` too), or None when no node is left."""
        busy = [] if busy is None else busy
        while True:
            decode = self.pool.pick(route.decode, exclude=tried, prefer=prefer, slack=self.affinity_slack)
            if not tried and prefer is not None:
                self.metrics.affinity.labels(route.id, "hit" if decode and decode.name == prefer else "skipped").inc()
            if decode is None:
                return None
            gen = Generation(self, route, decode, self.choose_prefill(route, prompt), prompt, prefix, fallbacks)
            try:
                await gen.open(sampling)
                return gen
            except UpstreamError as e:  # refused or failed before its stream started: the next node may serve
                await gen.close()
                if isinstance(e, NodeUnavailable):
                    self.pool.mark(decode, False, e.message)
                reason = DECODE_NODE_BUSY if isinstance(e, NodeBusy) else DECODE_NODE_FAILED
                if reason == DECODE_NODE_BUSY:
                    busy.append(decode.name)
                log.warning("decode node %s %s before streaming (%s); trying the next", decode.name,
                            "was busy" if reason == DECODE_NODE_BUSY else "failed", e.message)
                tried.append(decode.name)
                fallbacks.append(reason)
                self.metrics.fallback(route.id, reason)
            except BaseException:
                await gen.close()
                raise

    def _remembered(self, route: ModelRoute, prefix: list[bytes]) -> str | None:
        """The decode node that served this prompt's longest remembered prefix, if it is in the model's pool."""
        if not self.affinity.enabled:
            return None
        hit = self.affinity.lookup(prefix)
        if hit is None or hit[0] not in route.decode:
            self.metrics.affinity.labels(route.id, "miss").inc()
            return None
        return hit[0]

    async def _beyond_the_pool(self, route: ModelRoute, prompt: list[int], sampling: Sampling, tried: list[str],
                               fallbacks: list[str], busy: list[str] = ()) -> UpstreamGeneration:
        """No decode node can serve: the upstream when one is configured and the request can go there; else 429
        when healthy nodes are only full (at max_inflight, or refusing with 429), 503 when none is healthy."""
        full = [*busy, *(n.name for n in self.pool.healthy(route.decode) if n.name not in tried and n.full)]
        why = (f"every decode node of model {route.id!r} is full: at its max_inflight or in-flight KV cap "
               f"({', '.join(full)})" if full else
               f"no healthy decode node for model {route.id!r}" + (f" (tried {', '.join(tried)})" if tried else ""))
        inp = current_input()
        if route.upstream is not None and inp is not None and sampling.logprobs is None:
            gen = UpstreamGeneration(self, route, prompt, inp, [*fallbacks, UPSTREAM])
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
                self.metrics.fallback(route.id, UPSTREAM)
                return gen
        self.metrics.fallback(route.id, NO_CAPACITY)
        if full:
            raise RateLimited(f"{why}; retry in {self.retry_after_s}s", self.retry_after_s)
        raise NoHealthyNode(f"{why}; retry later")

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
        self.gens: list[Generation | UpstreamGeneration] = []
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
        self.gens = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]

    @property
    def first(self) -> Generation | UpstreamGeneration:
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
    async def _pump(index: int, gen: Generation | UpstreamGeneration, q: asyncio.Queue) -> None:
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
