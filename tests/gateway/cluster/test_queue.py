"""The gateway's request queue (gateway/cluster/queue.py, issue 33): busy requests wait, first come first served per
model and in turns between models, up to max_queued and max_wait_s; a queued stream opens at once; a client that
goes leaves the queue. Unit tests on the queue itself, then through the gateway with fake nodes."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.support.fakes import MODEL_ID, Cluster, chat_body
from gateway.cluster.queue import RequestQueue, Waiting
from gateway.errors import ClientDisconnected, RateLimited, ServerBusy
from kv_bridge.config.gateway import QueueConfig


class Slots:
    """A stand-in for the cluster: `n` generations at once; start() raises RateLimited when they are taken."""

    def __init__(self, n: int) -> None:
        self.free, self.order = n, []

    def start(self, name: str, retry: int = 1):
        async def go() -> str:
            if self.free == 0:
                raise RateLimited("no slot (its max_inflight)", retry)
            self.free -= 1
            self.order.append(name)
            return name
        return go

    def end(self, q: RequestQueue) -> None:
        self.free += 1
        q.notify()


def queue(max_queued: int = 512, **cfg) -> RequestQueue:
    return RequestQueue(QueueConfig(**{"poll_s": 10.0, **cfg}), lambda model: max_queued)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_first_come_first_served_within_a_model():
    q, slots = queue(), Slots(1)
    assert await q.run("a", slots.start("r0")) == "r0"
    tasks = [asyncio.create_task(q.run("a", slots.start(f"r{i}"))) for i in range(1, 5)]
    await settle()
    assert q.length("a") == 4
    for _ in range(4):
        slots.end(q)
        await settle()
    assert [await t for t in tasks] == ["r1", "r2", "r3", "r4"]
    assert slots.order == ["r0", "r1", "r2", "r3", "r4"] and q.length("a") == 0


async def test_models_take_turns():
    """One shared slot, three of model a queued before three of model b: freed slots alternate between them."""
    q, slots = queue(), Slots(1)
    await q.run("a", slots.start("a0"))
    tasks = [asyncio.create_task(q.run(m, slots.start(f"{m}{i}"))) for m in "ab" for i in (1, 2, 3)]
    await settle()
    for _ in range(6):
        slots.end(q)
        await settle()
    await asyncio.gather(*tasks)
    assert slots.order == ["a0", "a1", "b1", "a2", "b2", "a3", "b3"]


async def test_past_max_queued_is_server_busy_with_the_busy_answers_retry_after():
    q, slots = queue(max_queued=2, max_wait_s=30), Slots(0)
    tasks = [asyncio.create_task(q.run("a", slots.start(f"r{i}", retry=7))) for i in range(2)]
    await settle()
    with pytest.raises(ServerBusy) as e:
        await q.run("a", slots.start("r2"))
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "7" and e.value.reason == "full"
    assert "max_queued" in e.value.message and "max_inflight" in e.value.message
    assert q.length("b") == 0  # the bound is per model
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert q.length("a") == 0


async def test_wait_limit_is_server_busy_and_the_head_retries_on_its_own():
    """Nothing ever frees a slot the queue can see: the head retries every poll_s, then gives up at max_wait_s."""
    q, slots = queue(max_wait_s=0.3, poll_s=0.05), Slots(0)
    tries = 0

    async def start() -> str:
        nonlocal tries
        tries += 1
        raise RateLimited("every decode node is full", 2)

    with pytest.raises(ServerBusy) as e:
        await q.run("a", start)
    assert e.value.reason == "wait" and e.value.headers["Retry-After"] == "2" and tries >= 3
    assert q.length("a") == 0


async def test_a_client_that_goes_leaves_the_queue_and_the_next_moves_up():
    q, slots = queue(poll_s=0.05), Slots(1)
    await q.run("a", slots.start("r0"))
    gone = False
    leaving = asyncio.create_task(q.run("a", slots.start("r1"), Waiting(gone=lambda: gone)))
    staying = asyncio.create_task(q.run("a", slots.start("r2")))
    cancelled = asyncio.create_task(q.run("a", slots.start("r3")))
    await settle()
    assert q.length("a") == 3
    gone = True
    with pytest.raises(ClientDisconnected):
        await leaving
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    assert q.length("a") == 1  # no place leaked
    slots.end(q)
    assert await staying == "r2"
    assert q.length("a") == 0 and q.snapshot()["models"] == {}


async def test_queued_hook_runs_once_the_request_waits():
    q, slots = queue(), Slots(0)
    calls = []

    async def queued() -> None:
        calls.append(q.length("a"))

    task = asyncio.create_task(q.run("a", slots.start("r0"), Waiting(queued=queued)))
    await settle()
    assert calls == [1] and q.snapshot()["models"]["a"]["queued"] == 1
    slots.end(q)
    assert await task == "r0"


# ---- through the gateway (fake nodes, real HTTP) ----

@pytest.fixture
async def one_slot(empty_config):
    c = await Cluster(route={"max_inflight": 1}, gateway={"queue": {"poll_s": 0.05}}).start()
    yield c
    await c.stop()


async def _hold_one(c: Cluster) -> tuple[asyncio.Task, asyncio.Event]:
    gate = c.decode.hold = asyncio.Event()
    held = asyncio.create_task(c.chat(chat_body(max_tokens=4)))
    await c.wait_for(lambda: _true(c.decode.running >= 1))
    return held, gate


async def _true(v: bool) -> bool:
    return v


async def _queue_len(c: Cluster) -> int:
    async with c.http.get(f"{c.url}/health") as r:
        return (await r.json())["queue"]["models"].get(MODEL_ID, {}).get("queued", 0)


@pytest.mark.parametrize("path,body,first", [
    ("/v1/chat/completions", chat_body(max_tokens=4), b": queued\n\n"),
    ("/v1/messages", {"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
     b": queued\n\n"),
    ("/v1/responses", {"model": MODEL_ID, "input": "x", "max_output_tokens": 4}, b": queued\n\n"),
    ("/api/chat", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "options": {"num_predict": 4}},
     None),
])
async def test_a_queued_stream_opens_at_once_and_stays_valid(one_slot, path, body, first):
    """Headers (200, x-disagg-queued) while it waits; SSE writes only a comment line, which clients skip, NDJSON
    nothing; then the whole answer in the API's framing once it runs."""
    c = one_slot
    held, gate = await _hold_one(c)
    async with c.http.post(f"{c.url}{path}", json={**body, "stream": True}) as r:
        assert r.status == 200 and r.headers["x-disagg-queued"] == "true"
        assert await _queue_len(c) == 1
        if first is not None:
            assert await asyncio.wait_for(r.content.readexactly(len(first)), 5) == first
        gate.set()
        rest = (await r.read()).decode()
    assert (await held)[0] == 200
    if path == "/api/chat":
        lines = [json.loads(line) for line in rest.splitlines()]
        assert lines[-1]["done"] is True and all("error" not in x for x in lines)
    elif path == "/v1/messages":
        assert "event: message_start" in rest and "event: message_stop" in rest and "event: error" not in rest
    elif path == "/v1/responses":
        assert "event: response.created" in rest and "event: response.completed" in rest and "event: error" not in rest
    else:
        assert rest.rstrip().endswith("data: [DONE]") and '"error"' not in rest


async def test_a_queued_stream_past_the_wait_limit_ends_with_the_apis_error(empty_config):
    c = await Cluster(route={"max_inflight": 1}, gateway={"queue": {"poll_s": 0.05, "max_wait_s": 0.3}}).start()
    try:
        held, gate = await _hold_one(c)
        async with c.http.post(f"{c.url}/api/generate", json={"model": MODEL_ID, "prompt": "x"}) as r:
            assert r.status == 200
            lines = [json.loads(line) for line in (await r.read()).decode().splitlines()]
        assert len(lines) == 1 and lines[0]["error"].startswith("server busy, please try again.")
        gate.set()
        await held
    finally:
        await c.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_disconnects_leaves_the_gateways_queue(one_slot, stream):
    c = one_slot
    held, gate = await _hold_one(c)
    body = {**chat_body(max_tokens=4), "stream": stream}
    task = asyncio.create_task(c.http.post(f"{c.url}/v1/chat/completions", json=body,
                                           timeout=aiohttp.ClientTimeout(total=0.5)))

    async def queued() -> bool:
        return await _queue_len(c) == 1
    await c.wait_for(queued)
    if stream:
        resp = await task
        resp.close()  # the client hangs up while its request waits
    else:
        with pytest.raises(asyncio.TimeoutError):
            await task

    async def left() -> bool:
        return await _queue_len(c) == 0
    await c.wait_for(left)
    gate.set()
    assert (await held)[0] == 200
    assert c.decode.requests and len(c.decode.requests) == 1  # the one that left never reached a node
    status, _, _ = await c.chat(chat_body(max_tokens=2))
    assert status == 200


async def test_disagg_status_shows_the_gateways_queue(one_slot):
    """`disagg status` reads the queue from the gateway's /health: who waits now, and the waits so far."""
    from backends.cli import status

    c = one_slot
    held, gate = await _hold_one(c)
    waiting = asyncio.create_task(c.chat(chat_body(max_tokens=2)))
    await c.wait_for(lambda: _true_async(_queue_len(c), 1))
    port = int(c.url.rsplit(":", 1)[1])
    s = c.settings.model_copy(update={"gateway": c.settings.gateway.model_copy(update={"port": port})})
    async with aiohttp.ClientSession() as http:
        q = await status._queue(http, s, {}, {})
    assert q["models"][MODEL_ID]["queued"] == 1 and q["models"][MODEL_ID]["max_queued"] == 512
    text = status.render({"nodes": [], "links": [], "queue": q})
    row = next(line for line in text.splitlines() if line.split() and line.split()[0] == MODEL_ID)
    assert row.split()[1:3] == ["1", "512"]
    gate.set()
    await held
    assert (await waiting)[0] == 200
    async with aiohttp.ClientSession() as http:
        q = await status._queue(http, s, {}, {})
    assert q["models"] == {} and q["waits"][MODEL_ID]["count"] == 1
    assert "gateway queue (max wait 300 s)" in status.render({"nodes": [], "links": [], "queue": q})


async def _true_async(value, want) -> bool:
    return await value == want


async def test_real_clients_get_their_apis_busy_answer_past_max_queued(empty_config):
    """The ollama client and the OpenAI SDK, model at max_inflight with no room to queue (max_queued 0): Ollama's 503
    "server busy" (ollama.ResponseError), OpenAI's 429 (openai.RateLimitError; its own retries off), both with
    Retry-After. A streaming request refused this way gets the error as its status, before any stream opens."""
    import ollama
    import openai

    c = await Cluster(route={"max_inflight": 1, "max_queued": 0}, gateway={"retry_after_s": 4}).start()
    try:
        held, gate = await _hold_one(c)
        with pytest.raises(ollama.ResponseError) as e:
            await ollama.AsyncClient(host=c.url).generate(MODEL_ID, "x", options={"num_predict": 2})
        assert e.value.status_code == 503
        assert e.value.error == "server busy, please try again.  maximum pending requests exceeded"
        sdk = openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            await sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}],
                                              max_tokens=2, stream=True)
        assert e.value.status_code == 429 and e.value.response.headers["Retry-After"] == "4"
        assert e.value.code == "server_busy"
        await sdk.close()
        gate.set()
        assert (await held)[0] == 200
    finally:
        await c.stop()


async def test_n_choices_wait_for_all_their_slots_at_once(empty_config):
    """n=2 with one of the model's 2 slots taken waits holding none (two such requests holding one slot each would
    wait on each other), and runs when both are free; n above max_inflight could never run: 400."""
    c = await Cluster(route={"max_inflight": 2}, gateway={"queue": {"poll_s": 0.05}}).start()
    try:
        held, gate = await _hold_one(c)
        pair = asyncio.create_task(c.chat(chat_body(max_tokens=2, n=2)))
        await c.wait_for(lambda: _true_async(_queue_len(c), 1))
        assert c.decode.running == 1 and len(c.decode.requests) == 1  # the pair holds no slot while it waits
        gate.set()
        assert (await held)[0] == 200
        status, _, body = await pair
        assert status == 200 and len(body["choices"]) == 2
        status, _, body = await c.chat(chat_body(max_tokens=2, n=3))
        assert status == 400 and body["error"]["param"] == "n" and "max_inflight" in body["error"]["message"]
    finally:
        await c.stop()
