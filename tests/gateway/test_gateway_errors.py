"""Every bad input gets the right status and an OpenAI error object, never a 500 or a dropped connection."""

from __future__ import annotations

import pytest

from tests.support.fakes import LONG_TEXT, MODEL_ID, REPLY, Cluster, chat_body
from kv_bridge.protocol import Sampling

def assert_error(status: int, body: dict, want_status: int, *, param=None, code=None, type_=None) -> dict:
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == (type_ or ("invalid_request_error" if want_status < 500 else "server_error"))
    assert err["param"] == param
    assert err["code"] == code
    return err

async def test_malformed_json(cluster):
    status, _, body = await cluster.chat(raw=b'{"model": "smollm2:135m", "messages": [')
    assert_error(status, body, 400)

UNPARSEABLE = [b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
               b'{"model": "smollm2:135m", "messages": "\xff\xfe"}', b"\xff\xfe\x00{", b'{"a": 1e999999999999}x']


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("raw", UNPARSEABLE, ids=["deep-list", "deep-object", "bad-utf8-string", "bad-utf8", "trail"])
async def test_unparseable_body_is_400(cluster, path, raw):
    status, _, body = await cluster.post(path, raw=raw)
    assert_error(status, body, 400)
    status, _, _ = await cluster.chat(chat_body("hi"))  # the gateway still serves afterwards
    assert status == 200


async def test_body_not_an_object(cluster):
    status, _, body = await cluster.chat(raw=b"[1, 2]")
    assert_error(status, body, 400)

async def test_unknown_model(cluster):
    status, _, body = await cluster.chat({**chat_body(), "model": "nope:1b"})
    assert_error(status, body, 404, param="model", code="model_not_found")
    assert cluster.decode.requests == []

@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream": "yes please"}, "stream"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"seed": "abc"}, "seed"),
    ],
)
async def test_invalid_fields(cluster, patch, param):
    body = {k: v for k, v in {**chat_body(), **patch}.items() if v is not None}
    status, _, resp = await cluster.chat(body)
    assert_error(status, resp, 400, param=param)
    assert cluster.decode.requests == []

async def test_missing_model(cluster):
    body = chat_body()
    del body["model"]
    status, _, resp = await cluster.chat(body)
    assert_error(status, resp, 400, param="model")

async def test_extra_fields_allowed(cluster):
    """Fields OpenAI defines that change nothing here are accepted, answered as usual, and reach the node as the
    sampling they mean (no logprobs, no penalty)."""
    status, _, body = await cluster.chat(chat_body("hi", user="me", logprobs=False, frequency_penalty=0))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == REPLY and body["choices"][0]["logprobs"] is None
    sent = Sampling.from_json(cluster.decode.requests[-1])
    assert sent.logprobs is None and sent.frequency_penalty == 0.0 and "user" not in cluster.decode.requests[-1]

async def test_context_length_exceeded(empty_config):
    c = await Cluster(max_model_len=64).start()
    try:
        status, _, body = await c.chat(chat_body(LONG_TEXT, max_tokens=1))
        assert_error(status, body, 400, param="messages", code="context_length_exceeded")
        status, _, body = await c.chat(chat_body("hi", max_tokens=40))  # 31 prompt tokens + 40 > 64
        assert_error(status, body, 400, param="messages", code="context_length_exceeded")
        assert c.decode.requests == [] and c.prefill.requests == []  # refused before any work
        status, _, body = await c.chat(chat_body("hi"))  # the default budget shrinks to fit
        assert status == 200, body
        assert c.decode.requests[-1]["max_tokens"] == 64 - 31
    finally:
        await c.stop()

async def test_no_healthy_decode_node(cluster):
    cluster.decode.down = True
    await cluster.wait_for(lambda: _health(cluster, 503))
    status, headers, body = await cluster.chat(chat_body("hi"))
    assert_error(status, body, 503, code="no_healthy_node")
    assert int(headers["Retry-After"]) >= 1  # a client (or `disagg up` restarting the node) knows when to retry

async def test_decode_node_gone_is_503(empty_config):
    c = await Cluster(interval=60.0).start()
    try:
        await c.decode.stop()  # still marked up; the connect fails and no other node is left
        status, _, body = await c.chat(chat_body("hi"))
        assert_error(status, body, 503, code="no_healthy_node")
    finally:
        await c.stop()

async def test_decode_node_rejects_request(cluster):
    cluster.decode.model_id = "other"  # the node refuses with 400 before streaming
    status, _, body = await cluster.chat(chat_body("hi"))
    assert_error(status, body, 400)
    assert "unknown model" in body["error"]["message"]

async def test_unknown_route_and_method(cluster):
    async with cluster.http.get(f"{cluster.url}/v1/nope") as r:
        assert_error(r.status, await r.json(), 404, code="not_found")
    async with cluster.http.get(f"{cluster.url}/v1/chat/completions") as r:
        assert_error(r.status, await r.json(), 405, code="method_not_allowed")

@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1", 404), ("GET", "/v1/", 404), ("GET", "/v1/chat/completions/x", 404), ("DELETE", "/v1/models", 405),
    ("GET", "/nope", 404), ("POST", "/health", 405), ("PUT", "/metrics", 405), ("POST", "/", 405),
])
async def test_outside_ollama_api_unknown_paths_and_methods_are_openai_errors(cluster, method, path, status):
    """The OpenAI sub-app (/v1) and the gateway's root app (/health, /metrics, "/") answer in OpenAI's shape."""
    async with cluster.http.request(method, cluster.url + path) as r:
        err = assert_error(r.status, await r.json(), status, code="not_found" if status == 404 else
                           "method_not_allowed")
        assert path in err["message"] and method in err["message"]
        if status == 405:
            assert "GET" in r.headers["Allow"]


async def test_null_content_renders_empty(cluster, hf_tokenizer):
    """content null renders as the model's own chat template renders an empty message (transformers' reference)."""
    status, _, body = await cluster.chat({"model": MODEL_ID, "messages": [{"role": "user", "content": None}]})
    assert status == 200, body
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True,
                                            tokenize=False)
    assert cluster.decode.requests[-1]["token_ids"] == hf_tokenizer.encode(text, add_special_tokens=False)

async def _health(c: Cluster, status: int) -> bool:
    async with c.http.get(f"{c.url}/health") as r:
        return r.status == status
