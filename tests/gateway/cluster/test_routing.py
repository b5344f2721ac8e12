"""Routing per model: conditional disaggregation by prompt length, least-loaded choice, and prefix affinity (a
conversation's next turn goes back to the decode node that served its earlier turn) with two fake decode nodes.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.fakes import LONG_TEXT, MODEL_ID, Cluster, chat_body
from gateway.cluster.nodes import PrefixAffinity
from kv_bridge.config.models import ModelRoute
from tests.support import ROOT

TURN_1 = [{"role": "user", "content": LONG_TEXT}]  # about 70 prompt tokens: one whole 64-token block
ANSWER = {"role": "assistant", "content": "France is a country in Western Europe."}
TURN_2 = [*TURN_1, ANSWER, {"role": "user", "content": "And its capital?"}]
OTHER = [{"role": "user", "content": "Tell me everything about the oceans of the world, in great detail. " * 4}]


@pytest.fixture
async def two_decoders(empty_config):
    c = await Cluster(n_decode=2, n_prefill=1, interval=30.0).start()
    yield c
    await c.stop()


def body(messages: list[dict], **kw) -> dict:
    return {"model": MODEL_ID, "messages": messages, "max_tokens": 4, **kw}


async def busy(c: Cluster, node: int):
    """A request that lands on decoders[node] (both idle: the first in the route's list gets it) and stays there,
    held before its first token, until the returned awaitable is awaited: it lets the request finish."""
    assert all(d.running == 0 for d in c.decoders)
    gate = c.decoders[0].hold = asyncio.Event()
    task = asyncio.create_task(c.chat(body(OTHER, max_tokens=8)))

    async def started() -> bool:
        return c.decoders[0].running == 1

    await c.wait_for(started)

    async def finish():
        gate.set()
        return await task
    return finish()


async def affinity(c: Cluster, outcome: str) -> float:
    return await c.metric("disagg_prefix_affinity_total", model=MODEL_ID, outcome=outcome)


def test_config_toml_uses_the_measured_threshold():
    """bench/bench_threshold.py's break-even is the default (numbers at ModelRoute.min_disagg_tokens); the shipped
    config.toml must not drift from it."""
    import tomllib

    default = ModelRoute(id="m", path="p", decode=["d"]).min_disagg_tokens
    shipped = tomllib.loads((ROOT / "config.toml").read_text())
    assert [m["min_disagg_tokens"] for m in shipped["models"]] == [default]


@pytest.mark.parametrize("text,path", [("Hi", "local"), (LONG_TEXT, "disaggregated")])
async def test_prompt_length_decides_the_path(empty_config, text, path):
    c = await Cluster(min_disagg_tokens=48).start()
    try:
        status, headers, _ = await c.chat(chat_body(text, max_tokens=4))
        assert status == 200 and headers["x-disagg-path"] == path
    finally:
        await c.stop()


async def test_least_loaded_decode_node_is_chosen(two_decoders):
    c = two_decoders
    held = await busy(c, 0)
    status, headers, _ = await c.chat(body(TURN_1))
    assert status == 200 and headers["x-disagg-decode-node"] == "decode-1"
    await held


async def test_follow_up_turn_goes_back_to_its_decode_node(two_decoders):
    c = two_decoders
    held = await busy(c, 0)  # turn 1 lands on decode-1 only because decode-0 is busy
    status, headers, _ = await c.chat(body(TURN_1))
    assert status == 200 and headers["x-disagg-decode-node"] == "decode-1"
    await held
    hits = await affinity(c, "hit")
    # Both nodes idle now: without affinity decode-0 (first in the list) would win the tie.
    status, headers, _ = await c.chat(body(TURN_2))
    assert status == 200 and headers["x-disagg-decode-node"] == "decode-1"
    assert await affinity(c, "hit") == hits + 1
    # An unrelated conversation has no remembered prefix: least loaded, the first in the list.
    status, headers, _ = await c.chat(body([{"role": "user", "content": "Something else entirely. " * 12}]))
    assert headers["x-disagg-decode-node"] == "decode-0"


async def test_affinity_yields_to_a_down_or_busy_node(two_decoders):
    c = two_decoders
    held = await busy(c, 0)
    await c.chat(body(TURN_1))  # remembered: decode-1
    await held
    await c.decoders[1].stop()
    status, headers, _ = await c.chat(body(TURN_2))
    assert status == 200 and headers["x-disagg-decode-node"] == "decode-0"
    assert headers["x-disagg-fallbacks"] == "decode_node_failed"  # it was remembered, tried, and refused
    # decode-0 served TURN_2 and is remembered for its prefix now; decode-1 is down and no longer chosen.
    status, headers, _ = await c.chat(body(TURN_1))
    assert headers["x-disagg-decode-node"] == "decode-0" and "x-disagg-fallbacks" not in headers


async def test_affinity_gives_way_when_its_node_is_too_busy(empty_config):
    c = await Cluster(n_decode=2, interval=30.0, gateway={"affinity_slack": 0}).start()
    try:
        await c.chat(body(TURN_1))  # both idle: decode-0, remembered
        held = await busy(c, 0)
        skipped = await affinity(c, "skipped")
        status, headers, _ = await c.chat(body(TURN_2))  # its node has 1 in flight, decode-1 none: slack 0
        assert headers["x-disagg-decode-node"] == "decode-1"
        assert await affinity(c, "skipped") == skipped + 1
        await held
    finally:
        await c.stop()


async def test_affinity_off(empty_config):
    c = await Cluster(n_decode=2, interval=30.0, gateway={"affinity_entries": 0}).start()
    try:
        held = await busy(c, 0)
        await c.chat(body(TURN_1))
        await held
        status, headers, _ = await c.chat(body(TURN_2))
        assert headers["x-disagg-decode-node"] == "decode-0"
    finally:
        await c.stop()


def test_prefix_affinity_longest_prefix_wins_and_stays_bounded():
    a = PrefixAffinity(capacity=3, block=4)
    short, long = list(range(9)), list(range(14))  # 2 and 3 whole blocks
    a.remember(a.hashes("m", short), "n1")
    a.remember(a.hashes("m", long), "n2")
    assert a.lookup(a.hashes("m", long + [99])) == ("n2", 12)
    assert a.lookup(a.hashes("m", short[:8] + [99, 98, 97, 96])) == ("n1", 8)
    assert a.lookup(a.hashes("m", [5] + long)) is None  # prefixes only
    assert a.lookup(a.hashes("other-model", long)) is None  # the model id seeds the chain
    assert a.lookup(a.hashes("m", list(range(3)))) is None  # less than one block: nothing to match
    for i in range(5):
        a.remember(a.hashes("m", [100 + i] * 4), f"x{i}")
    assert len(a) == 3
    assert a.lookup(a.hashes("m", long)) is None  # evicted, least recently used first
    assert PrefixAffinity(capacity=0, block=4).hashes("m", long) == []
