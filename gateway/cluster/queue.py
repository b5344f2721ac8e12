"""The gateway's request queue, Ollama's way: a request that finds its model busy (at `max_inflight`, every decode node
full, the prefill admission queue full: each raises RateLimited) waits here rather than being refused, first come first
served per model and taking turns between models, up to `max_queued` waiting per model and `max_wait_s`; past either,
ServerBusy (each API's busy answer with Retry-After: Ollama 503, OpenAI and Anthropic 429)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

from kv_bridge.config.gateway import QueueConfig

from gateway.errors import ClientDisconnected, RateLimited, ServerBusy

T = TypeVar("T")


@dataclass
class Waiting:
    """What the queue asks of the request: has its client gone (it then leaves the queue), and what to do once it
    queues (a streaming request opens its stream then)."""

    gone: Callable[[], bool] = lambda: False
    queued: Callable[[], Awaitable[None]] | None = None
    waited_s: float = 0.0  # set by the queue: seconds from arrival to the start attempt (x-disagg-queue-ms)


@dataclass(eq=False)
class _Waiter:
    model: str
    seq: int
    since: float
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class RequestQueue:
    """Per model a list of waiters in arrival order; only its head tries to start, when woken (a generation ended
    anywhere: `notify`), when it became head, or every `poll_s` (a decode node's KV frees without the gateway seeing
    it). A head that tries leaves the list while it tries (the next may try too) and goes back in its arrival place if
    still busy. Event-loop only: nothing awaits while the lists change."""

    def __init__(self, cfg: QueueConfig, max_queued: Callable[[str], int], retry_after_s: int = 1,
                 observe: Callable[[str, float], None] | None = None,
                 refused: Callable[[str, str], None] | None = None) -> None:
        self.cfg = cfg
        self._max_queued = max_queued
        self.retry_after_s = max(1, retry_after_s)
        self._observe = observe or (lambda model, waited_s: None)  # every queued request's wait, when it leaves
        self._refused = refused or (lambda model, reason: None)  # reason: "full" (max_queued) or "wait" (max_wait_s)
        self._queues: OrderedDict[str, list[_Waiter]] = OrderedDict()  # rotation order: the next model's turn first
        self._seq = itertools.count()
        self._waits: dict[str, list[float]] = {}  # per model, the requests that queued: [count, total s, max s]
        self._last: dict[str, Busy] = {}  # per model: the busy answer its queue's head met last (why it waits)

    def length(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    async def run(self, model: str, start: Callable[[], Awaitable[T]], waiting: Waiting | None = None) -> T:
        """`start()` now if nobody of `model` waits and it is not busy; else wait for the turn and retry it."""
        waiting = waiting or Waiting()
        if not self._queues.get(model):
            try:
                waiting.waited_s = 0.0
                return await start()
            except RateLimited as e:
                busy = self._met(model, Busy(self.retry_after_s), e)
        else:  # it waits behind others: for the reason their head met last
            busy = Busy(**vars(self._last.get(model) or Busy(self.retry_after_s)))
        limit, ahead = self._max_queued(model), self.length(model)
        if ahead >= limit:
            self._refused(model, "full")
            raise ServerBusy(f"server busy: {ahead} requests of model {model!r} already wait (its max_queued)"
                             f"{busy.why}; retry in {busy.retry}s", busy.retry)
        waiter = _Waiter(model, next(self._seq), time.monotonic())
        self._insert(waiter)
        try:
            if waiting.queued is not None:
                await waiting.queued()
            while True:
                await self._turn(waiter, waiting.gone, busy)
                try:
                    waiting.waited_s = time.monotonic() - waiter.since
                    return await start()
                except RateLimited as e:
                    self._met(model, busy, e)
                    self._insert(waiter)
        finally:
            self._remove(waiter)
            if model not in self._queues:
                self._last.pop(model, None)
            waited = time.monotonic() - waiter.since
            w = self._waits.setdefault(model, [0, 0.0, 0.0])
            w[0], w[1], w[2] = w[0] + 1, w[1] + waited, max(w[2], waited)
            self._observe(model, waited)

    def _met(self, model: str, busy: "Busy", e: RateLimited) -> "Busy":
        busy.met(e, self.retry_after_s)
        self._last[model] = busy
        return busy

    def notify(self) -> None:
        """Capacity may have freed (a generation ended): every model's head tries, the model in turn first; that model
        goes last next time."""
        for queue in self._queues.values():
            queue[0].wake.set()
        if self._queues:
            self._queues.move_to_end(next(iter(self._queues)))

    async def _turn(self, waiter: _Waiter, gone: Callable[[], bool], busy: "Busy") -> None:
        """Return once `waiter` heads its model's list and should try, having taken it out of the list."""
        deadline = waiter.since + self.cfg.max_wait_s
        while True:
            if gone():
                raise ClientDisconnected("client closed the connection while its request was queued")
            left = deadline - time.monotonic()
            if left <= 0:
                self._refused(waiter.model, "wait")
                raise ServerBusy(f"server busy: model {waiter.model!r} did not free up in {self.cfg.max_wait_s:g}s "
                                 f"(max_wait_s){busy.why}; retry in {busy.retry}s", busy.retry, reason="wait")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(waiter.wake.wait(), min(self.cfg.poll_s, left))
            waiter.wake.clear()
            queue = self._queues.get(waiter.model)
            if queue and queue[0] is waiter:
                self._remove(waiter)
                return

    def _insert(self, waiter: _Waiter) -> None:
        """Into its arrival place (a head that tried and was still busy goes back before later arrivals)."""
        queue = self._queues.setdefault(waiter.model, [])
        i = len(queue)
        while i and queue[i - 1].seq > waiter.seq:
            i -= 1
        queue.insert(i, waiter)

    def _remove(self, waiter: _Waiter) -> None:
        """Out of the list (idempotent); the next head is woken to try at once."""
        queue = self._queues.get(waiter.model)
        if queue is None or waiter not in queue:
            return
        head = queue[0] is waiter
        queue.remove(waiter)
        if not queue:
            del self._queues[waiter.model]
        elif head:
            queue[0].wake.set()

    def snapshot(self) -> dict:
        """For /health and `disagg status`: per model with waiters, how many and the oldest's wait so far; per model
        that ever queued, how many did and their mean and longest wait."""
        now = time.monotonic()
        waits = {model: {"count": int(n), "mean_s": round(total / n, 3), "max_s": round(most, 3)}
                 for model, (n, total, most) in self._waits.items()}
        return {"max_wait_s": self.cfg.max_wait_s, "waits": waits, "models": {
            model: {"queued": len(q), "max_queued": self._max_queued(model),
                    "oldest_wait_s": round(now - min(w.since for w in q), 3)}
            for model, q in self._queues.items()}}


@dataclass
class Busy:
    """The last busy answer a request met: its reason for the final message, its Retry-After (never below the
    configured one)."""

    retry: int
    why: str = ""

    def met(self, e: RateLimited, floor: int) -> None:
        try:
            retry = int(e.headers.get("Retry-After", "1"))
        except ValueError:
            retry = 1
        self.retry = max(floor, retry)
        self.why = f" ({e.message.split('; retry in')[0]})"
