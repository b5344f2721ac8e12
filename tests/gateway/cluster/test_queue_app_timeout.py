"""The app's own request past its client timeout while it waits in the gateway's queue (gateway/cluster/queue.py):
the official ollama client's non-streaming generate, with a timeout shorter than the wait (the app's 300 s, scaled
down), gives up; the gateway drops the request from its queue and no node ever runs it."""

from __future__ import annotations

import asyncio

import httpx
import ollama
import pytest

from tests.support.fakes import MODEL_ID, Cluster, chat_body


async def _queued(c: Cluster) -> int:
    async with c.http.get(f"{c.url}/health") as r:
        return (await r.json())["queue"]["models"].get(MODEL_ID, {}).get("queued", 0)


async def test_a_request_its_client_abandoned_in_the_queue_never_runs(empty_config):
    c = await Cluster(route={"max_inflight": 1}, gateway={"queue": {"poll_s": 0.05}}).start()
    try:
        gate = c.decode.hold = asyncio.Event()
        held = asyncio.create_task(c.chat(chat_body(max_tokens=4)))
        await c.wait_for(lambda: _is(c.decode.running >= 1))
        app = ollama.AsyncClient(host=c.url, timeout=0.5)  # the app's client, its timeout scaled down
        waiting = asyncio.create_task(app.generate(model=MODEL_ID, prompt="Grade this notebook.",
                                                   options={"num_predict": 8}))
        await c.wait_for(lambda: _eq(_queued(c), 1))
        with pytest.raises(httpx.TimeoutException):
            await waiting
        await c.wait_for(lambda: _eq(_queued(c), 0))  # gone from the queue before any slot frees
        gate.set()
        assert (await held)[0] == 200
        await asyncio.sleep(0.3)  # a request left running for nobody would reach the node now
        assert len(c.decode.requests) == 1, [r.get("request_id") for r in c.decode.requests]
    finally:
        await c.stop()


async def _is(v: bool) -> bool:
    return v


async def _eq(value, want) -> bool:
    return await value == want
