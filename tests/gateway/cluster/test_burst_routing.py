"""Bursts with fake nodes: the KV deadline counts no-progress time, the gateway queues prefill work per node (past its
queue the request waits in the gateway's request queue, then 429 with Retry-After), chooses the path by predicted
time to first token, and falls back at once on failure.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tests.support.fakes import LONG_TEXT, MODEL_ID, Cluster
from gateway.cluster.rates import Rate
from kv_bridge import wire
from kv_bridge.config.gateway import RatesConfig
from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import Transfer, TransferError

SPEC = {"fingerprint": "abc", "num_layers": 2, "num_kv_heads": 1, "head_dim": 4}


def body(text: str = LONG_TEXT, **kw) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": text}], "max_tokens": 4, **kw}


def distinct(i: int) -> dict:
    return body(f"Request {i}. {LONG_TEXT}")


async def health(c: Cluster) -> dict:
    async with c.http.get(f"{c.url}/health") as r:
        return await r.json()


def waiting_for_prefill(h: dict) -> list[int]:
    """Each decode node's count of generations bound for it and still queued for a prefill node's admission."""
    return [n["waiting_for_prefill"] for n in h["nodes"] if n["role"] == "decode"]


async def test_kv_deadline_counts_silence_not_age():
    """Frames arriving for longer than the deadline keep the transfer alive; silence after them ends it."""
    t = Transfer("t1", 32, SPEC, KVConfig())
    hdr = wire.StreamHeader(transfer_id="t1", fingerprint="abc", num_layers=2, num_kv_heads=1, head_dim=4,
                            dtype="float32", start=0, num_tokens=32)
    t.begin(hdr)
    k = np.zeros((1, 1, 4), np.float32)

    # 40 of 64 layer-tokens, one per 0.05 s: at least 2 s of frames (sleep never wakes early) against a 1 s deadline,
    # each gap a twentieth of it. The transfer outliving the feeder is what shows age did not end it.
    async def trickle() -> None:
        for i in range(40):
            await asyncio.sleep(0.05)
            t.add(hdr, i % 2, i // 2, k, k)

    feeder = asyncio.create_task(trickle())
    with pytest.raises(TransferError) as e:
        await t.result(1.0)
    assert feeder.done(), "the deadline ended the transfer while frames still arrived"
    await feeder
    assert e.value.reason == "kv_timeout"  # and then the silence after the last frame did


async def test_queued_work_is_not_a_timeout(empty_config):
    """One prefill at a time (0.1 s each, a tenth of the decode deadline of 1 s) and 15 requests: the last waits at
    least 1.4 s (sleeps never wake early), past the deadline, yet all arrive disaggregated, because each waits in the
    gateway's admission queue, not on the decode node."""
    c = await Cluster(gateway={"admission": {"max_inflight_tokens": 1}}).start()
    try:
        c.decode.kv_timeout_s = 1.0
        c.prefill.seconds_per_token = 0.1 / 70
        results = await asyncio.gather(*(c.chat(distinct(i)) for i in range(15)))
        assert [(s, h["x-disagg-path"]) for s, h, _ in results] == [(200, "disaggregated")] * 15
        assert c.prefill.max_running == 1
        assert await c.metric("disagg_fallbacks_total", model=MODEL_ID, reason="kv_timeout") == 0
    finally:
        await c.stop()


async def test_full_prefill_queue_waits_in_the_gateway_then_busy_with_retry_after_from_it(empty_config):
    """The prefill admission queue full: a request waits in the gateway's queue (issue 33: it used to be answered 429
    at once) and is served when the prefill node frees; with no room left in the gateway's queue either
    (max_queued 0) it is answered 429, its Retry-After computed from the admission queue and the node's rate."""
    c = await Cluster(gateway={"admission": {"max_inflight_tokens": 1, "max_queued_tokens": 100},
                               "rates": {"prefill_tokens_per_s": 10.0, "local_prefill_tokens_per_s": 1.0},
                               "queue": {"poll_s": 0.1}}, route={"max_queued": 1}).start()
    try:
        gate = c.prefill.hold = asyncio.Event()  # the first prefill computes until the test lets it go
        first = [asyncio.create_task(c.chat(distinct(i))) for i in range(2)]  # one in flight, one queued

        async def queued() -> bool:
            return (await health(c))["admission"].get("prefill-0", {}).get("queued_requests") == 1

        await c.wait_for(queued)
        assert waiting_for_prefill(await health(c)) == [1]  # the queued one, bound for it: the cost model's arrivals
        third = asyncio.create_task(c.chat(distinct(9)))

        async def in_gateway_queue() -> bool:
            return (await health(c))["queue"]["models"].get(MODEL_ID, {}).get("queued") == 1

        await c.wait_for(in_gateway_queue)
        status, headers, err = await c.chat(distinct(10))  # max_queued 1: the gateway's queue is full too
        assert status == 429, err
        assert err["error"]["code"] == "server_busy" and "prompt tokens queued" in err["error"]["message"]
        # ~140 prompt tokens ahead at the 10 tok/s prior: about 14 s, not the 1 s default
        assert int(headers["Retry-After"]) >= 10
        gate.set()
        assert [r[0] for r in await asyncio.gather(*first, third)] == [200, 200, 200]
        assert waiting_for_prefill(await health(c)) == [0]
        assert (await health(c))["queue"]["models"] == {}
    finally:
        await c.stop()


async def test_cost_model_picks_local_when_prefill_is_slower(empty_config):
    """Above min_disagg_tokens, a prefill node predicted slower than local prefill is not waited for."""
    c = await Cluster(gateway={"rates": {"prefill_tokens_per_s": 1.0, "local_prefill_tokens_per_s": 1e4}}).start()
    try:
        status, headers, _ = await c.chat(body())
        assert (status, headers["x-disagg-path"]) == (200, "local")
        assert c.prefill.requests == []
        assert await c.metric("disagg_path_choices_total", model=MODEL_ID, path="local") == 1
    finally:
        await c.stop()


async def test_local_prefill_is_not_chosen_when_it_would_stall_the_decode_batch(empty_config):
    """Prefill predicted 2.5x slower than the decode node prefilling locally (20 against 50 tok/s): a request alone
    on the decode node goes local. One arriving while that one still decodes there would reach its first token
    sooner locally too (2T behind the first one's prompt, against 2.5T), but its prefill would hold the first one up
    for T: it goes disaggregated."""
    c = await Cluster(gateway={"rates": {"prefill_tokens_per_s": 20.0, "local_prefill_tokens_per_s": 50.0}}).start()
    try:
        c.decode.token_delay = 0.5
        first = asyncio.create_task(c.chat(distinct(1)))

        async def decoding() -> bool:
            return c.decode.running == 1

        await c.wait_for(decoding)
        status, headers, _ = await c.chat(distinct(2))
        assert (status, headers["x-disagg-path"]) == (200, "disaggregated")
        status, headers, _ = await first
        assert (status, headers["x-disagg-path"]) == (200, "local")
        assert await c.metric("disagg_path_choices_total", model=MODEL_ID, path="local") == 1
    finally:
        await c.stop()


async def test_rates_are_learned_and_shown(empty_config):
    c = await Cluster(gateway={"rates": {"link_bytes_per_s": 1000.0}}).start()
    try:
        c.prefill.seconds_per_token = 0.001
        defaults = RatesConfig()
        link = Rate(1000.0, defaults.smoothing, defaults.prior_weight_s)
        for i in range(3):
            status, headers, _ = await c.chat(distinct(i))
            assert (status, headers["x-disagg-path"]) == (200, "disaggregated")
            link.observe(int(headers["x-disagg-kv-tokens"]) * 1000, 0.005)  # the fake's kv_bytes over kv_link_s
        h = await health(c)
        learned = h["rates"]["prefill_tokens_per_s"]["prefill-0"]
        assert learned["samples"] == 3 and learned["value"] != learned["prior"]
        # The link's clock is the decode node's time mid-frame (kv_link_s), not HEADER -> last frame (kv_transfer_s).
        assert h["rates"]["link_bytes_per_s"]["prefill-0->decode-0"]["value"] == pytest.approx(link.value, 1e-3)
        assert h["admission"]["prefill-0"]["inflight_tokens"] == 0
        assert await c.metric("disagg_learned_rate", kind="prefill", node="prefill-0") == pytest.approx(
            learned["value"], rel=1e-3)
    finally:
        await c.stop()


async def test_prefill_node_marked_down_mid_call_falls_back_at_once(empty_config):
    """A hung prefill node whose health checks fail: the transfer is aborted when it is marked down, long before
    the decode node's own deadline, and the failure metric says why."""
    c = await Cluster(interval=0.2).start()
    try:
        c.decode.kv_timeout_s = 60.0
        c.prefill.fail = "hang"
        task = asyncio.create_task(c.chat(body()))

        async def calling() -> bool:
            return bool(c.prefill.requests)

        await c.wait_for(calling)
        c.prefill.down = True
        status, headers, _ = await asyncio.wait_for(task, 10)
        assert (status, headers["x-disagg-path"]) == (200, "fallback")
        assert headers["x-disagg-fallbacks"] == "prefill_node_failed,kv_aborted"
        assert await c.metric("disagg_prefill_failures_total", node="prefill-0", kind="node_down") == 1
    finally:
        await c.stop()


@pytest.mark.parametrize("fail, kind", [("http", "refused"), ("kv", "kv_not_delivered")])
async def test_refused_prefill_still_falls_back_at_once(empty_config, fail, kind):
    """An HTTP error, or the node's word that its KV stream never opened (the decode node, which saw no HEADER, cannot
    tell): the transfer is aborted at once, not waited out."""
    c = await Cluster().start()
    try:
        c.decode.kv_timeout_s = 60.0
        c.prefill.fail = fail
        status, headers, _ = await asyncio.wait_for(c.chat(body()), 10)
        assert (status, headers["x-disagg-path"]) == (200, "fallback")
        assert headers["x-disagg-fallbacks"] == "prefill_node_failed,kv_aborted"
        assert await c.metric("disagg_prefill_failures_total", node="prefill-0", kind=kind) == 1
    finally:
        await c.stop()


async def test_kv_wait_before_the_header_is_the_gateways_call():
    """Before the HEADER the prefill may be queued behind live work: only header_timeout bounds the wait there."""
    t = Transfer("t2", 8, SPEC, KVConfig())
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(t.result(0.2, header_timeout=30.0), 0.8)  # well past the idle deadline: still waiting
    t = Transfer("t3", 8, SPEC, KVConfig())
    with pytest.raises(TransferError, match="no HEADER"):
        await t.result(0.2, header_timeout=0.4)


async def test_stalled_prefill_node_falls_back_without_waiting_for_the_decode_deadline(empty_config):
    """A prefill node that stays healthy but answers nothing: after prefill_stall_s (plus the prompt's own predicted
    time) the gateway aborts the transfer; the failure metric says `stalled`."""
    c = await Cluster(gateway={"prefill_stall_s": 0.5}).start()
    try:
        c.decode.kv_timeout_s = 60.0
        c.prefill.fail = "hang"
        status, headers, _ = await asyncio.wait_for(c.chat(body()), 10)
        assert (status, headers["x-disagg-path"]) == (200, "fallback")
        assert headers["x-disagg-fallbacks"] == "prefill_node_failed,kv_aborted"
        assert await c.metric("disagg_prefill_failures_total", node="prefill-0", kind="stalled") == 1
    finally:
        await c.stop()
