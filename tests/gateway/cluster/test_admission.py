"""Admission to a prefill node (gateway/cluster/admission.py): bound, arrival order, turns per model, 429 with a
computed Retry-After, and cancellation of queued waiters leaving nothing behind."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.cluster.admission import Admission, NodeAdmission
from gateway.errors import RateLimited
from kv_bridge.config.gateway import AdmissionConfig


def gate(inflight: int = 1000, queued: int = 10_000, rate: float = 100.0) -> NodeAdmission:
    return NodeAdmission("p0", AdmissionConfig(max_inflight_tokens=inflight, max_queued_tokens=queued), lambda: rate)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def start(g: NodeAdmission, model: str, tokens: int, order: list):
    async def run():
        ticket = await g.acquire(model, tokens)
        order.append((model, tokens))
        return ticket
    task = asyncio.create_task(run())
    await settle()
    return task


async def test_under_the_bound_admits_at_once_and_release_gives_back():
    g = gate()
    a = await g.acquire("m", 600)
    b = await g.acquire("m", 400)
    assert g.inflight_tokens == 1000 and g.queued == 0
    a.release()
    a.release()  # idempotent
    b.release()
    assert g.inflight_tokens == 0


async def test_past_the_bound_queues_in_arrival_order():
    g, order = gate(), []
    first = await g.acquire("m", 900)
    tasks = [await start(g, "m", n, order) for n in (300, 50, 200)]
    assert order == [] and g.queued_tokens == 550 and g.tokens_ahead == 1450
    first.release()
    await settle()
    assert order == [("m", 300), ("m", 50), ("m", 200)]  # the 50 did not jump ahead while the 300 waited
    for t in tasks:
        t.result().release()
    assert g.inflight_tokens == 0 and g.queued_tokens == 0


async def test_models_take_turns():
    g, order = gate(inflight=100), []
    blocker = await g.acquire("a", 100)
    tasks = [await start(g, "a", 100, order) for _ in range(4)] + [await start(g, "b", 100, order)]
    blocker.release()
    for _ in range(5):
        await settle()
        done = [t for t in tasks if t.done() and not getattr(t, "released", False)]
        for t in done:
            t.released = True
            t.result().release()
    assert [m for m, _ in order] == ["a", "b", "a", "a", "a"]


async def test_a_prompt_over_the_bound_runs_alone():
    g, order = gate(inflight=1000), []
    small = await g.acquire("m", 10)
    big = await start(g, "m", 5000, order)
    assert not big.done()
    small.release()
    await settle()
    assert big.done() and g.inflight_tokens == 5000
    big.result().release()


async def test_full_queue_is_429_with_retry_after_from_queue_and_rate():
    g, order = gate(inflight=1000, queued=2000, rate=250.0), []
    held = await g.acquire("m", 1000)
    waiting = [await start(g, "m", 900, order), await start(g, "m", 900, order)]
    with pytest.raises(RateLimited) as e:
        await g.acquire("m", 300)
    assert e.value.status == 429
    assert e.value.headers["Retry-After"] == str(-(-(1000 + 1800) // 250))  # 12 s of work ahead at 250 tok/s
    assert g.queued_tokens == 1800  # the refused request left no trace
    for t in waiting:
        t.cancel()
    await settle()
    held.release()
    assert g.inflight_tokens == 0 and g.queued_tokens == 0


async def test_cancelled_waiters_leave_no_leak_and_unblock_the_rest():
    g, order = gate(inflight=100), []
    held = await g.acquire("m", 100)
    head = await start(g, "m", 100, order)
    behind = await start(g, "n", 50, order)
    head.cancel()
    await settle()
    assert head.cancelled() and g.queued_tokens == 50
    held.release()
    await settle()
    assert order == [("n", 50)] and g.inflight_tokens == 50
    behind.result().release()
    assert g.inflight_tokens == 0 and g.queued_tokens == 0 and g.queued == 0


async def test_cancel_in_the_same_tick_as_admission_releases():
    g, order = gate(inflight=100), []
    held = await g.acquire("m", 100)
    waiter = await start(g, "m", 100, order)
    held.release()  # admits the waiter: its future is done, but its task has not run yet
    waiter.cancel()
    await settle()
    assert waiter.cancelled() and order == []
    assert g.inflight_tokens == 0 and g.queued_tokens == 0


async def test_cancel_then_release_before_cleanup_runs():
    g, order = gate(inflight=100), []
    held = await g.acquire("m", 100)
    cancelled = await start(g, "m", 100, order)
    nxt = await start(g, "m", 100, order)
    cancelled.cancel()  # its future is cancelled now, its cleanup runs on the next tick
    held.release()  # pumps past the cancelled head
    await settle()
    assert order == [("m", 100)] and nxt.done() and g.inflight_tokens == 100
    nxt.result().release()
    assert g.inflight_tokens == 0 and g.queued_tokens == 0


async def test_random_load_with_cancellations_ends_balanced():
    rng = random.Random(3)
    g = gate(inflight=500, queued=3000)
    peak = 0

    async def client(i: int) -> None:
        nonlocal peak
        try:
            async with g.admit(rng.choice("abc"), rng.randint(1, 400)) as ticket:
                assert g.inflight_tokens <= 500 or g.inflight_tokens == ticket.tokens
                peak = max(peak, g.inflight_tokens)
                await asyncio.sleep(rng.random() * 0.002)
        except RateLimited:
            pass

    tasks = [asyncio.create_task(client(i)) for i in range(200)]
    await asyncio.sleep(0)
    for t in rng.sample(tasks, 60):
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert g.inflight_tokens == 0 and g.queued_tokens == 0 and g.queued == 0
    assert 0 < peak <= 500


def test_registry_one_gate_per_node():
    adm = Admission(AdmissionConfig(), rate_of=lambda name: {"p0": 1000.0, "p1": 50.0}[name])
    assert adm.node("p0") is adm.node("p0")
    assert adm.node("p1").retry_after_s(100) == 2
    assert set(adm.snapshot()) == {"p0", "p1"}
