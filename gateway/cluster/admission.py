"""Admission to a prefill node: prompt tokens in flight up to a bound, then a queue in arrival order that takes
turns between models, then 429 with a Retry-After computed from the queue and the node's rate."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kv_bridge.config.gateway import AdmissionConfig

from gateway.errors import RateLimited


@dataclass(eq=False)
class Ticket:
    """`tokens` admitted to one node; release() gives them back (once, however often it is called)."""

    model: str
    tokens: int
    _release: Callable[["Ticket"], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release(self)


@dataclass(eq=False)
class _Waiter:
    ticket: Ticket
    future: asyncio.Future


class NodeAdmission:
    """One prefill node's gate. Event-loop only (no locks needed: nothing here awaits while it mutates).

    Order: each model has its own FIFO; the head of the next model in turn goes first (round robin), and a head
    that does not fit blocks the others behind it, so a long prompt is never starved by short ones.
    """

    def __init__(self, name: str, cfg: AdmissionConfig, rate: Callable[[], float]) -> None:
        self.name = name
        self.cfg = cfg
        self.rate = rate  # this node's prompt tokens/s (gateway.cluster.rates), for Retry-After and wait estimates
        self.inflight_tokens = 0
        self.queued_tokens = 0
        self._queues: OrderedDict[str, deque[_Waiter]] = OrderedDict()  # rotation order: the next turn first

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def tokens_ahead(self) -> int:
        """Prompt tokens a new request would wait behind: the cost model's queue term."""
        return self.inflight_tokens + self.queued_tokens

    def _fits(self, tokens: int) -> bool:
        # A prompt over the bound still runs, alone: refusing it forever would be worse.
        return self.inflight_tokens == 0 or self.inflight_tokens + tokens <= self.cfg.max_inflight_tokens

    def retry_after_s(self, tokens: int = 0) -> int:
        """Seconds until the work ahead (in flight and queued) would have drained at the node's current rate."""
        return max(1, math.ceil((self.tokens_ahead + tokens) / max(self.rate(), 1e-9)))

    async def acquire(self, model: str, tokens: int) -> Ticket:
        """Wait for this request's turn; RateLimited (429 + Retry-After) when even the queue is full."""
        ticket = Ticket(model, tokens, self._release)
        if not self._queues and self._fits(tokens):
            self.inflight_tokens += tokens
            return ticket
        if self.queued_tokens + tokens > self.cfg.max_queued_tokens:
            wait = self.retry_after_s()
            raise RateLimited(f"prefill node {self.name} has {self.queued_tokens} prompt tokens queued and "
                              f"{self.inflight_tokens} in flight; retry in {wait}s", wait)
        waiter = _Waiter(ticket, asyncio.get_running_loop().create_future())
        self._queues.setdefault(model, deque()).append(waiter)
        self.queued_tokens += tokens
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                ticket.release()  # admitted in the same tick the caller was cancelled: give the tokens back
            else:
                self._drop(waiter)
            raise
        return ticket

    @contextlib.asynccontextmanager
    async def admit(self, model: str, tokens: int) -> AsyncIterator[Ticket]:
        ticket = await self.acquire(model, tokens)
        try:
            yield ticket
        finally:
            ticket.release()

    def _release(self, ticket: Ticket) -> None:
        self.inflight_tokens -= ticket.tokens
        self._pump()

    def _drop(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.ticket.model)
        if queue is None or waiter not in queue:
            return
        queue.remove(waiter)
        self.queued_tokens -= waiter.ticket.tokens
        if not queue:
            del self._queues[waiter.ticket.model]
        self._pump()  # the head may have left: the next one may fit now

    def _pump(self) -> None:
        """Admit heads in turn while they fit; a model that had its turn goes to the back of the rotation."""
        while self._queues:
            model, queue = next(iter(self._queues.items()))
            head = queue[0]
            cancelled = head.future.done()  # its task was cancelled and has not run its cleanup yet
            if not cancelled and not self._fits(head.ticket.tokens):
                return
            queue.popleft()
            self.queued_tokens -= head.ticket.tokens
            if not cancelled:
                self.inflight_tokens += head.ticket.tokens
                head.future.set_result(None)
            del self._queues[model]
            if queue:  # re-inserted at the end: the next model takes the next turn (a cancelled head took none)
                self._queues[model] = queue
                if cancelled:
                    self._queues.move_to_end(model, last=False)

    def snapshot(self) -> dict:
        """For /health and metrics."""
        return {"inflight_tokens": self.inflight_tokens, "queued_tokens": self.queued_tokens,
                "queued_requests": self.queued, "max_inflight_tokens": self.cfg.max_inflight_tokens,
                "max_queued_tokens": self.cfg.max_queued_tokens}


class Admission:
    """One NodeAdmission per prefill node, created on first use; `rate_of(node)` gives that node's tokens/s."""

    def __init__(self, cfg: AdmissionConfig, rate_of: Callable[[str], float]) -> None:
        self.cfg = cfg
        self.rate_of = rate_of
        self.nodes: dict[str, NodeAdmission] = {}

    def node(self, name: str) -> NodeAdmission:
        gate = self.nodes.get(name)
        if gate is None:
            gate = self.nodes[name] = NodeAdmission(name, self.cfg, lambda: self.rate_of(name))
        return gate

    def snapshot(self) -> dict:
        return {name: gate.snapshot() for name, gate in self.nodes.items()}
