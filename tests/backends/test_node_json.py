"""A node's JSON body that the parser cannot take (deep nesting, bad UTF-8) is a 400 in the node's error format."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from backends.common import json_body, node_app


async def _noop(app: web.Application) -> None:
    return None


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"a": "\xff"}', b"\xfe\xff{", b"{", b"[1]"])
async def test_unparseable_node_body_is_400(raw):
    app = node_app(lambda: {}, _noop, _noop)

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await json_body(request))

    app.router.add_post("/v1/echo", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}/v1/echo"
            async with http.post(url, data=raw, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400, await r.text()
                body = await r.json()
            assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_request"
            async with http.post(url, json={"ok": 1}) as r:  # still serving
                assert r.status == 200 and await r.json() == {"ok": 1}
    finally:
        await runner.cleanup()
