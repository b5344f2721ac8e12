"""Mid-stream decode failover: `Resumable` continues a client's stream on another decode node when the one serving
it breaks after `accepted` (decode_failover; docs/routing.md)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable

from kv_bridge.config.models import ModelRoute
from kv_bridge.protocol import DoneLine, Fallback, Path, Sampling, TokenLine
from kv_bridge.stops import StopMatcher

from gateway.errors import UpstreamError
from gateway.cluster.attempt import Attempt
from gateway.cluster.generation import Generation
from gateway.metrics import Metrics
from gateway.cluster.nodes import NodeState

# reopen(prompt, sampling, attempt: the nodes tried and fallbacks so far): a generation on another decode node, or None.
Reopen = Callable[[list[int], Sampling, Attempt], Awaitable[Generation | None]]

log = logging.getLogger("gateway.cluster.orchestrator")


class Resumable:
    """A decode generation that outlives its node: when the stream breaks after `accepted` (connection reset, end
    of stream without a done line, an error line), the same client stream goes on on another healthy decode node of
    the pool (decode_failover). The new generation's prompt is the client's prompt plus every token generated so
    far, its max_tokens what is left, its sampling the same; so a greedy stream reads exactly as an uninterrupted one.

    Stop strings: text the broken node held back (the start of a possible stop string, an incomplete character) is
    recomputed here from the token ids, and from then on the gateway matches the stop strings itself (the node's own
    StopMatcher, over the same text, one token behind) while the new node runs without them, so a stop string
    spanning the break is caught where an uninterrupted run would have caught it. With no other node the original
    error is raised: the client gets today's error event. Same interface as Generation.

    `reopen` opens the continuation, `check_node` health-checks the broken node now, `detokenize(model id, ids)`
    recomputes held-back text (None: no tokenizer, nothing recomputed)."""

    def __init__(self, gen: Generation, sampling: Sampling, reopen: Reopen, metrics: Metrics,
                 check_node: Callable[[NodeState], Awaitable[None]],
                 detokenize: Callable[[str, list[int]], str | None]) -> None:
        self.gen, self.sampling, self._reopen, self._metrics = gen, sampling, reopen, metrics
        self._check_node, self._detokenize = check_node, detokenize
        self.prompt = gen.prompt  # the client's prompt; usage counts it, not a continuation's longer one
        self.ids: list[int] = []  # every token received, across nodes
        self.done: DoneLine | None = None
        self.failovers = 0
        self._text = ""  # the text handed to the consumer (or waiting in `_pending`) so far
        self._carry = ""  # text the broken node held back, prepended to the next token's
        self._stops: StopMatcher | None = None  # the gateway's stop matching, after a failover with stop strings
        self._pending: TokenLine | None = None  # with `_stops`: the newest token, held until the next shows it final
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
    def planned_path(self) -> Path:
        return self.gen.planned_path

    @property
    def path(self) -> Path:
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

    async def tokens(self) -> AsyncIterator[TokenLine]:
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

    def _receive(self, tok: TokenLine) -> tuple[TokenLine, bool]:
        """The token as the client sees it, and whether the gateway's stop matching ended the generation."""
        self.ids.append(tok.token_id)
        text, hit = self._carry + tok.text, False
        self._carry = ""
        if self._stops is not None:
            text, hit = self._stops.feed(text)
        tok.text = text
        self._text += text
        return tok, hit

    def _final_done(self, stopped: bool) -> DoneLine:
        """The done line the client's request gets: its own prompt and every token generated for it."""
        if stopped or self.gen.done is None:  # the gateway hit a stop string, or there was nothing left to generate
            return DoneLine("stop" if stopped else "length", len(self.prompt), len(self.ids))
        if not self.failovers:
            return self.gen.done
        return replace(self.gen.done, prompt_tokens=len(self.prompt), completion_tokens=len(self.ids))

    async def _close_broken(self) -> None:
        """Drop the broken stream; a dead node is marked down now rather than at the next health poll."""
        await self.gen.close()
        await self._check_node(self.gen.decode)

    async def _resume(self, err: UpstreamError) -> bool:
        """Continue on another decode node of the pool; False when none can (the caller then raises `err`)."""
        broken = self.gen
        self._carry = self._held_text()
        stops = self.sampling.stop
        # A grammar goes on from where it stopped: the new node feeds it the tokens generated so far first.
        sampling = replace(self.sampling, max_tokens=self.sampling.max_tokens - len(self.ids), stop=[],
                           grammar_generated=len(self.ids) if self.sampling.grammar else 0)
        prompt = [*self.prompt, *self.ids]
        fallbacks = [*broken.fallbacks, Fallback.DECODE_FAILOVER]
        gen = await self._reopen(prompt, sampling, Attempt(tried=self._tried, fallbacks=fallbacks))
        if gen is None:
            log.warning("decode node %s broke mid-stream (%s) and no other decode node can continue %s",
                        broken.decode.name, err.message, broken.request_id)
            return False
        log.warning("decode node %s broke mid-stream after %d tokens (%s); %s continues on %s as %s",
                    broken.decode.name, len(self.ids), err.message, broken.request_id, gen.decode.name,
                    gen.request_id)
        self._metrics.fallback(self.route.id, Fallback.DECODE_FAILOVER)
        self._tried.append(gen.decode.name)
        if stops:  # a fresh matcher: what the old one held is in `_carry` now
            self._stops = StopMatcher(stops)
        self.gen, self.failovers = gen, self.failovers + 1
        return True

    def _held_text(self) -> str:
        """The text of the tokens received that the broken node never sent (the detokenizer's incomplete character,
        the StopMatcher's tail): the full decode of the ids, less what the consumer already has."""
        full = self._detokenize(self.route.id, self.ids)
        if full is None or not full.startswith(self._text):
            if full is not None:
                log.warning("%s: the decoded tokens do not extend the streamed text; dropping the held-back text",
                            self.request_id)
            return ""
        return full[len(self._text):]
