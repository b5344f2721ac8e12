"""What both node services share: the error tree and its JSON translation, /health, and start-up."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from kv_bridge.config import NodeConfig

log = logging.getLogger(__name__)


class NodeError(Exception):
    """An error a node reports to its caller as {"error": {"message", "type", "code"}} with `status`."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


def bad_request(message: str) -> NodeError:
    return NodeError(400, message, "invalid_request")


def error_response(status: int, message: str, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except NodeError as e:
        return error_response(e.status, str(e), e.code)
    except web.HTTPException:
        raise
    except Exception as e:  # the one boundary where anything else becomes a 500 with a message
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"{type(e).__name__}: {e}")


async def json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def node_app(health: Callable[[], dict], on_start: Callable[[web.Application], Awaitable[None]],
             on_stop: Callable[[web.Application], Awaitable[None]]) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=64 << 20)

    async def health_handler(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **health()})

    app.router.add_get("/health", health_handler)
    app.on_startup.append(on_start)
    app.on_shutdown.append(on_stop)
    return app


def run_app(app: web.Application, node: NodeConfig) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {node.name} %(levelname)s %(name)s: %(message)s")
    web.run_app(app, host=node.host, port=node.port, print=lambda *a: log.info("%s listening on %s", node.name, node.url),
                shutdown_timeout=5)
