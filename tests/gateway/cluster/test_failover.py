"""Fallbacks in order, each with a node stopped or failing on purpose (fake nodes, real HTTP): another decode node,
another prefill node, decode-local prefill, the upstream (through litellm, against a fake OpenAI-compatible server),
then 503; and at capacity the gateway's queue, then each API's busy answer with Retry-After. Each step shows in
x-disagg-path / x-disagg-fallbacks and in disagg_fallbacks_total{reason}.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.fakes import LONG_TEXT, MODEL_ID, REPLY, UPSTREAM_REPLY, Cluster, chat_body

# litellm's own pydantic usage, not ours
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the 'model_:DeprecationWarning")
# The gateway polls health every 30 s here, so only the request path can notice a node stopped mid-test.
SLOW_POLL = {"interval": 30.0}


@pytest.fixture
async def make_cluster(empty_config):
    made: list[Cluster] = []

    async def make(**kw) -> Cluster:
        c = await Cluster(**{**SLOW_POLL, **kw}).start()
        made.append(c)
        return c

    yield make
    for c in made:
        await c.stop()


async def fallbacks(c: Cluster, reason: str) -> float:
    return await c.metric("disagg_fallbacks_total", model=MODEL_ID, reason=reason)


async def test_stopped_decode_node_fails_over_to_the_next(make_cluster):
    c = await make_cluster(n_decode=2)
    await c.decoders[0].stop()  # refuses connections; the gateway still believes it is up
    before = await fallbacks(c, "decode_node_failed")
    status, headers, body = await c.chat(chat_body(max_tokens=32))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == REPLY
    assert headers["x-disagg-decode-node"] == "decode-1"
    assert headers["x-disagg-fallbacks"] == "decode_node_failed"
    assert await fallbacks(c, "decode_node_failed") == before + 1
    # The refused node is marked down at once, so the next request goes straight to decode-1.
    async with c.http.get(f"{c.url}/health") as r:
        nodes = {n["name"]: n for n in (await r.json())["nodes"]}
    assert nodes["decode-0"]["up"] is False
    status, headers, _ = await c.chat(chat_body(max_tokens=4))
    assert status == 200 and "x-disagg-fallbacks" not in headers
    assert await fallbacks(c, "decode_node_failed") == before + 1


async def test_decode_node_500_before_the_stream_fails_over_without_marking_it_down(make_cluster):
    c = await make_cluster(n_decode=2)
    c.decoders[0].mode = "http_500"
    status, headers, body = await c.events("/v1/chat/completions", chat_body(max_tokens=32))
    assert status == 200
    assert headers["x-disagg-decode-node"] == "decode-1"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in body[:-1] if e["choices"])
    assert text == REPLY
    assert await fallbacks(c, "decode_node_failed") == 1
    assert c.decoders[0].requests and c.decoders[1].requests
    async with c.http.get(f"{c.url}/health") as r:
        assert all(n["up"] for n in (await r.json())["nodes"])


async def test_stopped_prefill_node_hands_over_to_another_prefill_node(make_cluster):
    c = await make_cluster(n_prefill=2)
    await c.prefills[0].stop()
    status, headers, body = await c.chat(chat_body(LONG_TEXT, max_tokens=8))
    assert status == 200, body
    assert headers["x-disagg-path"] == "disaggregated"
    assert headers["x-disagg-fallbacks"] == "prefill_node_failed"
    assert int(headers["x-disagg-kv-tokens"]) == body["usage"]["prompt_tokens"] - 1
    assert len(c.prefills[1].requests) == 1
    assert await fallbacks(c, "prefill_node_failed") == 1


async def test_every_prefill_node_stopped_falls_back_to_local_prefill(make_cluster):
    c = await make_cluster(n_prefill=2)
    for p in c.prefills:
        await p.stop()
    status, headers, body = await c.chat(chat_body(LONG_TEXT, max_tokens=8))
    assert status == 200, body
    assert headers["x-disagg-path"] == "fallback"
    assert headers["x-disagg-fallbacks"] == "prefill_node_failed,prefill_node_failed,kv_aborted"
    assert body["choices"][0]["message"]["content"] == c.decode.reply_text(8)
    assert await fallbacks(c, "prefill_node_failed") == 2
    assert await fallbacks(c, "kv_aborted") == 1


async def test_prefill_500_does_not_retry_elsewhere(make_cluster):
    """A prefill node that answered 500 may have sent part of the KV already: decode prefills locally instead."""
    c = await make_cluster(n_prefill=2)
    c.prefills[0].fail = "http"
    status, headers, _ = await c.chat(chat_body(LONG_TEXT, max_tokens=4))
    assert status == 200
    assert headers["x-disagg-path"] == "fallback"
    assert headers["x-disagg-fallbacks"] == "prefill_node_failed,kv_aborted"
    assert not c.prefills[1].requests


@pytest.mark.parametrize("reason", ["kv_error", "kv_timeout"])
async def test_kv_failures_are_counted_by_reason(make_cluster, reason):
    c = await make_cluster()
    if reason == "kv_error":
        c.decode.mode = "kv_error"
    else:
        c.prefill.fail = "hang"
        c.decode.kv_timeout_s = 0.5
    status, headers, _ = await c.chat(chat_body(LONG_TEXT, max_tokens=4))
    assert status == 200
    assert headers["x-disagg-path"] == "fallback" and headers["x-disagg-fallbacks"] == reason
    assert await fallbacks(c, reason) == 1
    ok = await c.metric("disagg_requests_total", model=MODEL_ID, path="fallback", status="ok")
    assert ok == 1


async def test_all_decode_nodes_down_goes_upstream(make_cluster):
    c = await make_cluster(n_decode=2, upstream=True)
    for d in c.decoders:
        await d.stop()
    status, headers, body = await c.chat(chat_body(max_tokens=32, temperature=0, seed=7, stop=["zz"]))
    assert status == 200, body
    assert headers["x-disagg-path"] == "upstream"
    assert headers["x-disagg-fallbacks"] == "decode_node_failed,decode_node_failed,upstream"
    assert body["choices"][0]["message"]["content"] == UPSTREAM_REPLY
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 8, "total_tokens": 19}
    sent = c.upstream.requests[-1]
    assert sent["model"] == "gpt-fake" and sent["stream"] is True
    assert sent["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    assert (sent["max_tokens"], sent["temperature"], sent["seed"], sent["stop"]) == (32, 0, 7, ["zz"])
    assert await fallbacks(c, "upstream") == 1
    ok = await c.metric("disagg_requests_total", model=MODEL_ID, path="upstream", status="ok")
    assert ok == 1


async def test_upstream_streams_openai_and_ollama_shapes(make_cluster):
    c = await make_cluster(upstream=True)
    c.decode.down = True  # answers 503 (loading): marked down, then upstream
    status, headers, events = await c.events("/v1/chat/completions", chat_body(max_tokens=3))
    assert status == 200 and headers["x-disagg-path"] == "upstream"
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == "Upstream says: the"
    assert events[-2]["choices"][0]["finish_reason"] == "length"

    status, headers, body = await c.post("/v1/completions", {"model": MODEL_ID, "prompt": "Say hi", "max_tokens": 50})
    assert status == 200 and headers["x-disagg-path"] == "upstream"
    assert body["choices"][0]["text"] == UPSTREAM_REPLY
    assert c.upstream.requests[-1]["prompt"] == "Say hi"

    status, headers, body = await c.post("/api/chat", {"model": MODEL_ID, "stream": False,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and headers["x-disagg-path"] == "upstream"
    assert body["message"]["content"] == UPSTREAM_REPLY and body["done"] is True


async def test_upstream_key_comes_from_the_named_environment_variable(make_cluster, monkeypatch):
    monkeypatch.setenv("FAKE_UPSTREAM_KEY", "sk-test-123")
    c = await make_cluster(upstream=True, route={"upstream": {"api_key_env": "FAKE_UPSTREAM_KEY"}})
    await c.decode.stop()
    status, headers, _ = await c.chat(chat_body())
    assert status == 200 and headers["x-disagg-path"] == "upstream"
    assert c.upstream.headers[-1]["Authorization"] == "Bearer sk-test-123"


async def test_unset_api_key_variable_fails_at_start_up(empty_config):
    from kv_bridge.config.source import ConfigError

    c = Cluster(upstream=True, route={"upstream": {"api_key_env": "NO_SUCH_KEY_VAR"}})
    with pytest.raises(ConfigError, match="NO_SUCH_KEY_VAR"):
        await c.start()
    await c.stop()


async def test_upstream_is_not_used_for_what_it_cannot_answer(make_cluster):
    c = await make_cluster(upstream=True)
    await c.decode.stop()
    status, _, body = await c.chat(chat_body(logprobs=True, top_logprobs=2))  # our token ids: not the upstream's
    assert status == 503 and body["error"]["code"] == "no_healthy_node"
    status, _, _ = await c.post("/v1/completions", {"model": MODEL_ID, "prompt": [1, 2, 3]})
    assert status == 503
    assert not c.upstream.requests


async def test_upstream_failure_and_no_upstream_answer_503(make_cluster):
    c = await make_cluster(upstream=True)
    await c.decode.stop()
    c.upstream.fail = "http"
    status, _, body = await c.chat(chat_body())
    assert status == 503
    assert body["error"]["code"] == "no_healthy_node" and "upstream failed" in body["error"]["message"]
    assert await fallbacks(c, "no_capacity") == 1
    assert await fallbacks(c, "upstream") == 0

    bare = await make_cluster()
    await bare.decode.stop()
    status, _, body = await bare.chat(chat_body())
    assert status == 503 and body["error"]["code"] == "no_healthy_node"
    status, _, body = await bare.post("/api/chat", {"model": MODEL_ID, "stream": False,
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and isinstance(body["error"], str)
    assert await fallbacks(bare, "no_capacity") == 2


async def _hold(c: Cluster, n: int) -> tuple[list[asyncio.Task], asyncio.Event]:
    """n streaming requests in flight (at most one a decode node), each held by its fake decode node before its first
    token until the returned event is set."""
    gate = asyncio.Event()
    for d in c.decoders:
        d.hold = gate
    tasks = [asyncio.create_task(c.events("/v1/chat/completions", chat_body(max_tokens=8))) for _ in range(n)]
    await c.wait_for(lambda: _running(c, n))
    return tasks, gate


async def _running(c: Cluster, n: int) -> bool:
    return sum(d.running for d in c.decoders) >= n


async def _queued(c: Cluster, n: int) -> None:
    async def check() -> bool:
        async with c.http.get(f"{c.url}/health") as r:
            return (await r.json())["queue"]["models"].get(MODEL_ID, {}).get("queued", 0) == n
    await c.wait_for(check)


async def test_model_at_max_inflight_queues_then_each_api_answers_busy_past_max_queued(make_cluster):
    """Issue 33: at max_inflight a request waits in the gateway's queue (it used to be answered 429 at once), and is
    served when the generation ahead ends; past max_queued each API's busy answer with Retry-After: OpenAI 429,
    Anthropic 429 rate_limit_error, Ollama 503 with its own "server busy" words."""
    c = await make_cluster(route={"max_inflight": 1, "max_queued": 1}, gateway={"retry_after_s": 3})
    held, gate = await _hold(c, 1)
    waiting = asyncio.create_task(c.chat(chat_body(max_tokens=2)))
    await _queued(c, 1)
    assert await c.metric("disagg_queue_length", model=MODEL_ID) == 1
    assert await c.metric("disagg_requests_running", model=MODEL_ID) == 1  # waiting is not running
    status, headers, body = await c.chat(chat_body())
    assert status == 429
    assert headers["Retry-After"] == "3"
    assert body["error"]["code"] == "server_busy" and body["error"]["type"] == "requests"
    assert "max_queued" in body["error"]["message"] and "max_inflight" in body["error"]["message"]
    status, headers, body = await c.post("/api/chat", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}]})
    assert status == 503 and headers["Retry-After"] == "3"
    assert body == {"error": "server busy, please try again.  maximum pending requests exceeded"}
    status, headers, body = await c.post("/v1/messages", {"model": MODEL_ID, "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "x"}]})
    assert status == 429 and headers["Retry-After"] == "3"
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert await fallbacks(c, "no_capacity") == 3
    assert await c.metric("disagg_queue_refused_total", model=MODEL_ID, reason="full") == 3
    assert await c.metric("disagg_requests_total", model=MODEL_ID, path="none", status="4xx") == 3
    assert not waiting.done()
    gate.set()
    for t in held:
        assert (await t)[0] == 200
    status, headers, _ = await waiting
    assert status == 200 and "x-disagg-path" in headers
    assert await c.metric("disagg_queue_wait_seconds_count", model=MODEL_ID) == 1
    assert await c.metric("disagg_queue_length", model=MODEL_ID) == 0
    status, _, _ = await c.chat(chat_body(max_tokens=2))  # capacity is back
    assert status == 200


async def test_full_decode_nodes_spill_to_upstream_or_queue(make_cluster):
    """Every decode node at its max_inflight: the upstream when there is one, else the request waits its turn (issue
    33: it used to be answered 429)."""
    c = await make_cluster(nodes_extra={"decode-0": {"max_inflight": 1}})
    held, gate = await _hold(c, 1)
    waiting = asyncio.create_task(c.chat(chat_body()))
    await _queued(c, 1)
    gate.set()
    await asyncio.gather(*held)
    status, headers, body = await waiting
    assert status == 200 and headers["x-disagg-decode-node"] == "decode-0", body

    up = await make_cluster(upstream=True, nodes_extra={"decode-0": {"max_inflight": 1}})
    held, gate = await _hold(up, 1)
    status, headers, body = await up.chat(chat_body())
    assert status == 200 and headers["x-disagg-path"] == "upstream"
    assert headers["x-disagg-fallbacks"] == "upstream"
    gate.set()
    await asyncio.gather(*held)


async def test_litellm_as_a_client_of_the_gateway(cluster, monkeypatch):
    """litellm's OpenAI provider pointed at the gateway: whole (sync client, in a thread: the gateway runs on this
    loop) and streamed answers come back intact."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    import litellm
    kw = {"model": f"openai/{MODEL_ID}", "api_base": cluster.url + "/v1", "api_key": "x",
          "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32}
    r = await asyncio.to_thread(litellm.completion, **kw)
    assert r.choices[0].message.content == REPLY
    assert r.usage.completion_tokens == len(cluster.decode.reply_ids)
    stream = await litellm.acompletion(stream=True, **kw)
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == REPLY


@pytest.mark.parametrize("provider", ["ollama_chat", "ollama"])
async def test_ollama_upstream(make_cluster, provider):
    """An Ollama server as the upstream (litellm's ollama_chat -> /api/chat, ollama -> /api/generate): here another
    gateway of ours, which is an Ollama drop-in."""
    ollama = await make_cluster()
    c = await make_cluster(route={"upstream": {"model": f"{provider}/{MODEL_ID}", "api_base": ollama.url}})
    await c.decode.stop()
    status, headers, body = await c.chat(chat_body(max_tokens=32, temperature=0))
    assert status == 200, body
    assert headers["x-disagg-path"] == "upstream"
    assert body["choices"][0]["message"]["content"] == REPLY
    assert ollama.decode.requests[-1]["max_tokens"] == 32
    status, headers, events = await c.events("/v1/chat/completions", chat_body(max_tokens=32))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert status == 200 and text == REPLY


async def test_decode_node_over_its_kv_cap_hands_the_request_to_the_next(make_cluster):
    c = await make_cluster(n_decode=2)
    c.decoders[0].mode = "kv_capacity"
    status, headers, body = await c.chat(chat_body(LONG_TEXT, max_tokens=8))
    assert status == 200, body
    assert headers["x-disagg-decode-node"] == "decode-1"
    assert headers["x-disagg-fallbacks"] == "decode_node_busy"
    assert await fallbacks(c, "decode_node_busy") == 1
    async with c.http.get(f"{c.url}/health") as r:  # busy is not down
        nodes = {n["name"]: n for n in (await r.json())["nodes"]}
    assert nodes["decode-0"]["up"] is True


async def test_every_decode_node_over_its_kv_cap_waits_then_is_served_or_busy(make_cluster):
    """Every decode node answering 429 kv_capacity: the request waits in the gateway's queue and retries (issue 33: it
    used to be answered 429 at once); served once a node has room, the API's busy answer after max_wait_s."""
    c = await make_cluster(gateway={"retry_after_s": 2, "queue": {"max_wait_s": 0.5, "poll_s": 0.05}})
    c.decode.mode = "kv_capacity"
    status, headers, body = await c.chat(chat_body(LONG_TEXT, max_tokens=8))
    assert status == 429 and headers["Retry-After"] == "2"
    assert body["error"]["code"] == "server_busy" and "in-flight KV cap" in body["error"]["message"]
    assert "max_wait_s" in body["error"]["message"]
    assert await fallbacks(c, "decode_node_busy") >= 2 and await fallbacks(c, "no_capacity") == 1
    assert await c.metric("disagg_queue_refused_total", model=MODEL_ID, reason="wait") == 1
    status, _, _ = await c.chat(chat_body("hi", max_tokens=2))  # below the split threshold: no KV, served
    assert status == 200
    # The second request must outlast the moments it waits unseen (a loaded machine): the same config object, longer
    c.settings.gateway.queue.max_wait_s = 60
    refused = await fallbacks(c, "decode_node_busy")
    waiting = asyncio.create_task(c.chat(chat_body(LONG_TEXT, max_tokens=8)))

    # Refused twice: the second try came from the queue's poll. (Not `queued` in /health: a waiter leaves the list
    # while it tries, so on a loaded box the poll of /health can miss it for seconds; a clean-clone run did.)
    async def retried() -> bool:
        return await fallbacks(c, "decode_node_busy") >= refused + 2
    await c.wait_for(retried, timeout=60)
    c.decode.mode = None  # its KV freed where the gateway cannot see it: the queue's poll finds it
    status, _, body = await waiting
    assert status == 200, body


async def test_upstream_gets_the_format(make_cluster):
    """JSON mode and schemas go upstream as OpenAI's response_format (litellm maps it per provider)."""
    c = await make_cluster(upstream=True)
    c.decode.down = True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    status, headers, _ = await c.chat(chat_body(max_tokens=8, response_format=fmt))
    assert status == 200 and headers["x-disagg-path"] == "upstream"
    sent = c.upstream.requests[-1]["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["schema"] == schema
    assert sent["json_schema"]["strict"] is True
    status, _, _ = await c.post("/api/chat", {"model": MODEL_ID, "stream": False, "format": "json",
                                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and c.upstream.requests[-1]["response_format"] == {"type": "json_object"}
