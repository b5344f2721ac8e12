"""gateway.api.boundary on real aiohttp apps: a root app and a mounted sub-app each answer errors and 401s in their own
shape, and a root app's middlewares leave its sub-app's requests to the sub-app."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from gateway.api import boundary
from gateway.api.ollama.errors import OLLAMA
from gateway.api.openai.errors import OPENAI
from gateway.auth import APIKeys
from gateway.errors import RateLimited, UpstreamError

KEY = "sk-boundary-test"


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def boom(request: web.Request) -> web.Response:
    raise RuntimeError("a bug")


async def node_failed(request: web.Request) -> web.Response:
    raise UpstreamError("decode node broke the protocol")


async def busy(request: web.Request) -> web.Response:
    raise RateLimited("model at its limit", retry_after_s=3)


def _routes(app: web.Application) -> web.Application:
    for path, handler in (("/ok", ok), ("/boom", boom), ("/node", node_failed), ("/busy", busy)):
        app.router.add_get(path, handler)
    return app


@pytest.fixture(params=[None, KEY], ids=["open", "keyed"])
async def url(request):
    keys = None if request.param is None else APIKeys([request.param])
    root = _routes(web.Application(middlewares=boundary.middlewares(OPENAI, keys, {ok})))
    # the sub-app serves the same `ok` handler, but only the root app named it open
    root.add_subapp("/sub", _routes(web.Application(middlewares=boundary.middlewares(OLLAMA, keys))))
    runner = web.AppRunner(root, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", request.param
    await runner.cleanup()


async def _get(base: str, path: str, key: str | None) -> tuple[int, dict, object]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http, http.get(base + path, headers=headers) as r:
        body = await r.json() if r.content_type == "application/json" else await r.text()
        return r.status, dict(r.headers), body


def _openai(body, code=None) -> str:
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code, body
    return body["error"]["message"]


def _ollama(body) -> str:
    assert list(body) == ["error"] and isinstance(body["error"], str), body
    return body["error"]


async def test_each_app_answers_errors_in_its_shape(url):
    base, key = url
    status, _, body = await _get(base, "/boom", key)
    assert status == 500 and "internal server error" in _openai(body)
    status, _, body = await _get(base, "/sub/boom", key)
    assert status == 500 and "internal server error" in _ollama(body)
    status, _, body = await _get(base, "/node", key)
    assert status == 502 and _openai(body, "upstream_error") == "decode node broke the protocol"
    status, _, body = await _get(base, "/sub/node", key)  # Ollama answers a node's failure with 500
    assert status == 500 and _ollama(body) == "decode node broke the protocol"
    for path, shape in (("/busy", lambda b: _openai(b, "rate_limit_exceeded")), ("/sub/busy", _ollama)):
        status, headers, body = await _get(base, path, key)
        assert status == 429 and headers["Retry-After"] == "3" and shape(body) == "model at its limit"
    status, _, body = await _get(base, "/sub/nope", key)
    assert status == 404 and _ollama(body) == "GET /sub/nope is not an Ollama API endpoint"
    status, _, body = await _get(base, "/nope", key)
    assert status == 404 and _openai(body, "not_found") == "Unknown request URL: GET /nope"


async def test_keys_are_checked_per_app_in_its_shape(url):
    base, key = url
    if key is None:
        assert (await _get(base, "/sub/ok", None))[:3:2] == (200, "ok")
        return
    assert (await _get(base, "/ok", None))[:3:2] == (200, "ok")  # open on the root app
    status, headers, body = await _get(base, "/sub/ok", None)  # the same handler is not open on the sub-app
    assert status == 401 and _ollama(body).startswith("unauthorized: Missing API key")
    assert headers["WWW-Authenticate"] == 'Bearer realm="disagg"'
    status, headers, body = await _get(base, "/node", "sk-wrong")
    assert status == 401 and _openai(body, "invalid_api_key") == "Incorrect API key provided"
    assert headers["WWW-Authenticate"] == 'Bearer realm="disagg", error="invalid_token"'
    status, _, body = await _get(base, "/sub/node", "sk-wrong")  # the sub-app's check, not the root app's
    assert status == 401 and _ollama(body) == "unauthorized: Incorrect API key provided"
    assert (await _get(base, "/sub/ok", key))[:3:2] == (200, "ok")
