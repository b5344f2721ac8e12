"""Ollama errors are `{"error": "..."}` with Ollama's status codes; Ollama requests count in the gateway metrics."""

from __future__ import annotations

import json
import types

import pytest

from tests.support import oracle
from tests.support.fakes import MODEL_ID
from gateway.errors import ModelNotFound
from gateway.api.ollama.translate import find_route

TOTAL = "disagg_requests_total"


async def send(c, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict, dict | list]:
    kw = {"data": raw, "headers": {"Content-Type": "application/json"}} if raw is not None else {"json": body}
    async with c.http.request(method, f"{c.url}{path}", **kw) as r:
        text = await r.text()
    lines = text.splitlines()
    body = json.loads(text) if len(lines) == 1 else [json.loads(x) for x in lines]
    for item in body if isinstance(body, list) else [body]:
        oracle.check(path, r.status, item)
    return r.status, dict(r.headers), body


def assert_error(status: int, body: dict, want: int, *needles: str) -> None:
    assert status == want, body
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    for needle in needles:
        assert needle in body["error"], body


def chat(**kw) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "stream": False, **kw}


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/api/show"])
async def test_bad_json(cluster, path):
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw, needle in ((b'{"model": ', "invalid JSON"), (b"", "missing request body"), (b"[1]", "JSON object"),
                        (deep, "invalid JSON"), (b'{"model": "\xff"}', "invalid JSON")):
        status, _, body = await send(cluster, "POST", path, raw=raw)
        assert_error(status, body, 400, needle)


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/api/show"])
async def test_model_required_and_unknown(cluster, path):
    status, _, body = await send(cluster, "POST", path, {"prompt": "hi"})
    assert_error(status, body, 400, "model is required")
    status, _, body = await send(cluster, "POST", path, {"model": "llama3:8b", "prompt": "hi",
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and body == {"error": "model 'llama3:8b' not found"}
    assert cluster.decode.requests == []


@pytest.mark.parametrize(("patch", "needle"), [
    ({"format": "xml"}, "format"),
    ({"format": 5}, "format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "does not support tools"),
    ({"think": True}, "does not support thinking"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "does not support images"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"stream": "yes please"}, "stream"),
    ({"options": {"temperature": "hot"}}, "options.temperature"),
    ({"options": {"temperature": -1}}, "options.temperature"),
    ({"options": {"top_p": 1.5}}, "options.top_p"),
    ({"options": {"num_ctx": 0}}, "options.num_ctx"),
    ({"options": {"stop": [1, 2]}}, "options.stop"),
    ({"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
    ({"options": "fast"}, "options"),
])
async def test_chat_bad_fields(cluster, patch, needle):
    status, _, body = await send(cluster, "POST", "/api/chat", chat(**patch))
    assert_error(status, body, 400, needle)
    assert cluster.decode.requests == []


@pytest.mark.parametrize(("patch", "needle"), [
    ({"suffix": "}"}, "does not support insert"),
    ({"template": "{{ .Prompt }}"}, "template"),
    ({"images": ["aGk="]}, "does not support images"),
    ({"context": [1, -5]}, "context"),
    ({"context": [10**9]}, "outside the vocabulary"),
    ({"format": "yaml"}, "format"),
])
async def test_generate_bad_fields(cluster, patch, needle):
    status, _, body = await send(cluster, "POST", "/api/generate", {"model": MODEL_ID, "prompt": "hi", **patch})
    assert_error(status, body, 400, needle)


async def test_unknown_endpoint_and_method(cluster):
    status, _, body = await send(cluster, "GET", "/api/pull")
    assert_error(status, body, 404, "/api/pull")
    status, headers, body = await send(cluster, "GET", "/api/generate")
    assert_error(status, body, 405, "GET")
    assert "POST" in headers["Allow"]
    # OpenAI paths keep OpenAI's error shape.
    status, _, body = await send(cluster, "GET", "/v1/nope")
    assert status == 404 and isinstance(body["error"], dict)


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/api", 404), ("GET", "/api/", 404), ("POST", "/api/version/x", 404), ("DELETE", "/api/tags", 405),
    ("GET", "/api/chat", 405), ("PUT", "/api/show", 405),
])
async def test_everything_under_api_answers_in_ollama_shape(cluster, method, path, status):
    status_got, headers, body = await send(cluster, method, path)
    assert_error(status_got, body, status, path if status == 404 else method)
    if status == 405:
        assert headers["Allow"]


async def test_no_healthy_decode_node_is_503(cluster):
    cluster.decode.down = True

    async def down() -> bool:
        status, _, _ = await send(cluster, "POST", "/api/generate", {"model": MODEL_ID})
        return status == 503
    await cluster.wait_for(down)
    for path, body in (("/api/chat", chat()), ("/api/generate", {"model": MODEL_ID, "prompt": "hi"})):
        status, _, err = await send(cluster, "POST", path, body)
        assert_error(status, err, 503, "no healthy decode node")


async def test_node_failure_before_the_answer_is_500(cluster):
    cluster.decode.mode = "fail_mid_stream"
    status, _, body = await send(cluster, "POST", "/api/chat", chat())
    assert_error(status, body, 500, "fake decode failure")


async def test_mid_stream_failure_ends_with_an_error_line(cluster):
    cluster.decode.mode = "fail_mid_stream"
    async with cluster.http.post(f"{cluster.url}/api/generate", json={"model": MODEL_ID, "prompt": "hi"}) as r:
        lines = [json.loads(x) for x in (await r.read()).decode().splitlines() if x.strip()]
    assert r.status == 200
    assert [x["done"] for x in lines[:-1]] == [False, False]
    assert set(lines[-1]) == {"error"} and "fake decode failure" in lines[-1]["error"]


async def test_client_disconnect_closes_upstream(cluster):
    cluster.decode.token_delay = 0.1
    async with cluster.http.post(f"{cluster.url}/api/chat", json=chat(stream=True)) as r:
        await r.content.readline()  # the first token has arrived: generation is running
        r.close()

    async def closed() -> bool:
        return bool(cluster.decode.disconnects)
    await cluster.wait_for(closed)
    assert await cluster.metric(TOTAL, model=MODEL_ID, path="local", status="cancelled") == 1
    assert await cluster.metric("disagg_requests_running", model=MODEL_ID) == 0


async def test_requests_are_counted_like_openai(cluster):
    m = cluster.metric
    await send(cluster, "POST", "/api/chat", chat())
    await send(cluster, "POST", "/api/generate", {"model": MODEL_ID, "prompt": "hi"})  # streamed
    assert await m(TOTAL, model=MODEL_ID, path="local", status="ok") == 2
    assert await m("disagg_generation_tokens_total", model=MODEL_ID) == 14
    assert await m("disagg_time_to_first_token_seconds_count", model=MODEL_ID) == 2
    await send(cluster, "POST", "/api/chat", {"model": "nope"})
    assert await m(TOTAL, model="unknown", path="none", status="4xx") == 1
    await send(cluster, "POST", "/api/generate", {"model": MODEL_ID})  # a load request generates nothing
    assert await m(TOTAL, model=MODEL_ID, path="none", status="ok") == 0
    cluster.decode.mode = "fail_mid_stream"
    await send(cluster, "POST", "/api/generate", {"model": MODEL_ID, "prompt": "hi"})
    assert await m(TOTAL, model=MODEL_ID, path="local", status="error") == 1
    assert await m("disagg_requests_running", model=MODEL_ID) == 0


def test_latest_tag_aliases():
    routes = {"qwen3-coder:latest": "a", "smollm2:135m": "b"}
    st = types.SimpleNamespace(settings=types.SimpleNamespace(route=routes.get))
    assert find_route(st, "qwen3-coder") == "a"
    assert find_route(st, "smollm2:135m") == "b"
    with pytest.raises(ModelNotFound, match="model 'smollm2' not found"):
        find_route(st, "smollm2")


@pytest.mark.parametrize(("fmt", "grammar"), [
    ("json", {"type": "json_object"}),
    ({"type": "object", "properties": {"a": {"type": "string"}}},
     {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}, "strict": False}),
    ("", None),
])
@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
async def test_format_reaches_the_decode_node(cluster, path, fmt, grammar):
    body = chat(format=fmt, stream=False) if path == "/api/chat" else {"model": MODEL_ID, "prompt": "hi",
                                                                       "format": fmt, "stream": False}
    status, _, out = await send(cluster, "POST", path, body)
    assert status == 200, out
    assert cluster.decode.requests[-1]["grammar"] == grammar
