"""Gateway orchestration over real HTTP against fake nodes: paths, headers, prefill/abort, streaming, health."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.support import oracle
from tests.support.fakes import LONG_TEXT, MODEL_DIR, MODEL_ID, REPLY, Cluster, chat_body
from gateway.text.tokenizer import ChatTokenizer

TOK = ChatTokenizer.from_folder(MODEL_DIR)

def prompt_ids(text: str) -> list[int]:
    return TOK.encode_chat([{"role": "user", "content": text}])

async def stream_events(c: Cluster, body: dict) -> tuple[int, dict, list]:
    """POST a streaming request; return (status, headers, parsed data events with '[DONE]' kept as a string)."""
    events = []
    async with c.http.post(f"{c.url}/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        buf = (await r.read()).decode()
    for block in buf.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            oracle.check_openai_chunk("/v1/chat/completions", events[-1])
    return r.status, dict(r.headers), events

async def test_disaggregated_request(cluster):
    status, headers, body = await cluster.chat(chat_body(LONG_TEXT, max_tokens=32, temperature=0))
    assert status == 200, body
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt = prompt_ids(LONG_TEXT)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 7, "total_tokens": len(prompt) + 7}
    assert headers["x-disagg-path"] == "disaggregated"
    assert headers["x-disagg-kv-tokens"] == str(len(prompt) - 1)
    assert headers["x-disagg-decode-node"] == "decode-0"
    assert float(headers["x-disagg-prefill-ms"]) > 0

    gen = cluster.decode.requests[-1]
    assert gen["token_ids"] == prompt and gen["kv"] == {"tokens": len(prompt) - 1}
    assert gen["model"] == MODEL_ID and gen["max_tokens"] == 32 and gen["temperature"] == 0
    assert gen["top_p"] == 1.0 and gen["seed"] is None and gen["stop"] == []
    pre = cluster.prefill.requests[-1]
    assert pre["token_ids"] == prompt[:-1]
    assert pre["request_id"] == gen["request_id"] and pre["request_id"].startswith("req-")
    assert pre["kv_target"] == {"host": "127.0.0.1", "port": cluster.decode.kv_port}
    assert pre["model"] == MODEL_ID

async def test_short_prompt_is_local(cluster):
    status, headers, body = await cluster.chat(chat_body("hi"))
    assert status == 200, body
    assert len(prompt_ids("hi")) - 1 < 32
    assert headers["x-disagg-path"] == "local"
    assert headers["x-disagg-kv-tokens"] == "0"
    assert headers["x-disagg-prefill-ms"] == "0"
    assert cluster.decode.requests[-1]["kv"] is None
    assert cluster.prefill.requests == []

async def test_no_prefill_node_is_local(local_cluster):
    status, headers, body = await local_cluster.chat(chat_body(LONG_TEXT))
    assert status == 200, body
    assert headers["x-disagg-path"] == "local"
    assert local_cluster.decode.requests[-1]["kv"] is None

async def test_prefill_node_down_is_local(cluster):
    cluster.prefill.down = True
    await cluster.wait_for(lambda: _node_up(cluster, "prefill-0", False))
    status, headers, _ = await cluster.chat(chat_body(LONG_TEXT))
    assert status == 200 and headers["x-disagg-path"] == "local"
    assert cluster.prefill.requests == []

async def test_fallback_reported_by_decode(cluster):
    cluster.decode.mode = "kv_error"
    status, headers, body = await cluster.chat(chat_body(LONG_TEXT))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == REPLY
    assert headers["x-disagg-path"] == "fallback"
    assert headers["x-disagg-kv-tokens"] == "0"

async def test_prefill_failure_sends_abort(cluster):
    cluster.prefill.fail = "http"
    status, headers, body = await cluster.chat(chat_body(LONG_TEXT))
    assert status == 200, body
    rid = cluster.decode.requests[-1]["request_id"]
    assert cluster.decode.aborts == [rid]
    assert headers["x-disagg-path"] == "fallback"
    assert body["choices"][0]["message"]["content"] == REPLY

async def test_prefill_unreachable_sends_abort(cluster):
    await cluster.prefill.stop()  # the gateway still thinks it is up until the next health poll
    status, headers, body = await cluster.chat(chat_body(LONG_TEXT))
    assert status == 200, body
    assert cluster.decode.aborts == [cluster.decode.requests[-1]["request_id"]]
    assert headers["x-disagg-path"] == "fallback"

async def test_streaming_matches_non_streaming(cluster):
    for text in ("hi", LONG_TEXT):
        _, _, full = await cluster.chat(chat_body(text, max_tokens=5))
        status, headers, events = await stream_events(cluster, chat_body(text, max_tokens=5))
        assert status == 200
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert streamed == full["choices"][0]["message"]["content"] == cluster.decode.reply_text(5)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert "usage" not in chunks[-1]
        assert headers["x-disagg-decode-node"] == "decode-0"
        assert headers["x-disagg-path"] == ("local" if text == "hi" else "disaggregated")

async def test_stream_include_usage(cluster):
    body = chat_body("hi", stream_options={"include_usage": True})
    _, _, events = await stream_events(cluster, body)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["choices"] == []
    n = len(prompt_ids("hi"))
    assert last["usage"] == {"prompt_tokens": n, "completion_tokens": 7, "total_tokens": n + 7}
    assert all(e["usage"] is None for e in events[:-2])

async def test_mid_stream_error_event(cluster):
    cluster.decode.mode = "fail_mid_stream"
    status, _, events = await stream_events(cluster, chat_body("hi"))
    assert status == 200
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["type"] == "server_error" and "fake decode failure" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}

async def test_mid_stream_connection_drop(cluster):
    cluster.decode.mode = "drop_mid_stream"
    _, _, events = await stream_events(cluster, chat_body("hi"))
    assert events[-1] == "[DONE]" and "error" in events[-2]
    status, _, body = await cluster.chat(chat_body("hi"))
    assert status == 502 and body["error"]["type"] == "server_error"

async def test_client_disconnect_closes_upstream(cluster):
    cluster.decode.token_delay = 0.1
    async with cluster.http.post(f"{cluster.url}/v1/chat/completions", json=chat_body("hi", stream=True)) as r:
        await r.content.readline()  # the role chunk has arrived: generation is running
        r.close()
    await cluster.wait_for(lambda: _true(bool(cluster.decode.disconnects)))
    assert cluster.decode.disconnects == [cluster.decode.requests[-1]["request_id"]]

async def test_sampling_fields_forwarded(cluster):
    body = chat_body("hi", max_completion_tokens=3, temperature=0.7, top_p=0.9, seed=42, stop="\n")
    status, _, resp = await cluster.chat(body)
    assert status == 200, resp
    gen = cluster.decode.requests[-1]
    assert (gen["max_tokens"], gen["temperature"], gen["top_p"], gen["seed"], gen["stop"]) == (3, 0.7, 0.9, 42, ["\n"])
    assert resp["choices"][0]["finish_reason"] == "length"
    assert resp["usage"]["completion_tokens"] == 3

async def test_speculation_switch_forwarded(cluster):
    """x-disagg-speculative (kv_bridge.protocol SPECULATIVE_HEADER) reaches the decode node as `speculative`, from
    OpenAI and Ollama alike; a value other than on/off is the client's error."""
    await cluster.chat(chat_body("hi"))
    assert cluster.decode.requests[-1]["speculative"] is True
    for path, body in (("/v1/chat/completions", chat_body("hi")),
                       ("/api/generate", {"model": MODEL_ID, "prompt": "hi", "stream": False})):
        async with cluster.http.post(cluster.url + path, json=body, headers={"x-disagg-speculative": "off"}) as r:
            assert r.status == 200, await r.text()
        assert cluster.decode.requests[-1]["speculative"] is False
    async with cluster.http.post(cluster.url + "/v1/chat/completions", json=chat_body("hi"),
                                 headers={"x-disagg-speculative": "maybe"}) as r:
        assert r.status == 400 and "x-disagg-speculative" in (await r.json())["error"]["message"]


async def test_default_sampling(cluster):
    await cluster.chat(chat_body("hi"))
    gen = cluster.decode.requests[-1]
    # No max_tokens: the room left in the context, as vLLM gives (max_model_len 4096 in the fake settings).
    room = cluster.settings.models[0].max_model_len - len(gen["token_ids"])
    assert (gen["max_tokens"], gen["temperature"], gen["top_p"]) == (room, 1.0, 1.0)

async def test_least_loaded_decode_and_failover(empty_config):
    c = await Cluster(n_decode=2, n_prefill=0, interval=60.0).start()
    try:
        c.decoders[0].token_delay = 0.1
        slow = asyncio.create_task(c.chat(chat_body("hi")))
        await c.wait_for(lambda: _true(len(c.decoders[0].requests) == 1))
        _, headers, _ = await c.chat(chat_body("hi"))
        assert headers["x-disagg-decode-node"] == "decode-1"  # decode-0 has one in flight
        assert (await slow)[0] == 200
        await c.decoders[0].stop()  # unreachable, but still marked up: the gateway must fail over
        status, headers, _ = await c.chat(chat_body("hi"))
        assert status == 200 and headers["x-disagg-decode-node"] == "decode-1"
    finally:
        await c.stop()

async def test_models_endpoint(cluster):
    async with cluster.http.get(f"{cluster.url}/v1/models") as r:
        body = await r.json()
    assert r.status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL_ID]
    assert body["data"][0]["object"] == "model"

async def test_health(cluster):
    async with cluster.http.get(f"{cluster.url}/health") as r:
        body = await r.json()
    assert r.status == 200 and body["status"] == "ok"
    nodes = {n["name"]: (n["role"], n["up"]) for n in body["nodes"]}
    assert nodes == {"decode-0": ("decode", True), "prefill-0": ("prefill", True)}

    cluster.decode.down = True
    await cluster.wait_for(lambda: _health_status(cluster, 503))
    cluster.decode.down = False
    await cluster.wait_for(lambda: _health_status(cluster, 200))

async def test_health_ignores_prefill(cluster):
    cluster.prefill.down = True
    await cluster.wait_for(lambda: _node_up(cluster, "prefill-0", False))
    assert await _health_status(cluster, 200)

async def _true(value: bool) -> bool:
    return value

async def _health_status(c: Cluster, status: int) -> bool:
    async with c.http.get(f"{c.url}/health") as r:
        return r.status == status

async def _node_up(c: Cluster, name: str, up: bool) -> bool:
    async with c.http.get(f"{c.url}/health") as r:
        body = await r.json()
    return any(n["name"] == name and n["up"] is up for n in body["nodes"])

async def test_non_streaming_client_disconnect_closes_upstream(cluster):
    cluster.decode.token_delay = 0.1
    timeout = aiohttp.ClientTimeout(total=0.25)
    try:
        await cluster.http.post(f"{cluster.url}/v1/chat/completions", json=chat_body("hi"), timeout=timeout)
    except asyncio.TimeoutError:
        pass
    await cluster.wait_for(lambda: _true(bool(cluster.decode.disconnects)))
    assert await cluster.metric("disagg_requests_running", model=MODEL_ID) == 0
    assert await cluster.metric("disagg_requests_total", model=MODEL_ID, path="local", status="cancelled") == 1
