"""The gateway's aiohttp application: OpenAI routes, /health, /metrics, and the one error boundary.

`create_app(settings)` builds it (tokenizers load here, so a bad model folder fails at start-up);
`serve(settings)` runs it until interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kv_bridge.config import Settings, resolve_model_path

from . import auth, ollama
from .chat import STATE, GatewayState, chat_completions
from .completions import completions
from .errors import APIError
from .metrics import Metrics
from .nodes import NodePool
from .orchestrator import Orchestrator
from .tokenizer import ChatTokenizer

log = logging.getLogger("gateway")

MAX_BODY_BYTES = 32 << 20  # long prompts are large JSON; aiohttp's 1 MiB default is too small


def _error_response(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers or None)


def _from_http_exception(e: web.HTTPException, request: web.Request) -> APIError:
    if e.status == 404:
        msg, code = f"Unknown request URL: {request.method} {request.path}", "not_found"
    elif e.status == 405:
        msg, code = f"Method {request.method} is not allowed on {request.path}", "method_not_allowed"
    elif e.status == 413:
        msg, code = f"request body is larger than {MAX_BODY_BYTES} bytes", "request_too_large"
    else:
        msg, code = e.text or e.reason, None
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return APIError(msg, status=e.status, type=kind, code=code)


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """The one place errors become responses: `{"error": {"message", "type", "param", "code"}}`."""
    try:
        return await handler(request)
    except APIError as e:
        return _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = _error_response(_from_http_exception(e, request))
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(APIError("internal server error; see gateway logs"))


async def list_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    data = [_model_card(name, st.created) for m in st.settings.models for name in m.names]  # aliases too
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    route = st.route(request.match_info["model"])
    return web.json_response(_model_card(request.match_info["model"], st.created))


def _model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "disagg"}


async def health(request: web.Request) -> web.Response:
    """200 when every model has a healthy decode node (prefill is optional: decode can prefill locally)."""
    st = request.app[STATE]
    serving = st.pool.serving(st.settings.models)
    models = [
        {"id": m.id, "decode_up": len(st.pool.healthy(m.decode)), "prefill_up": len(st.pool.healthy(m.prefill))}
        for m in st.settings.models
    ]
    body = {"status": "ok" if serving else "unavailable", "nodes": st.pool.snapshot(), "models": models}
    return web.json_response(body, status=200 if serving else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """One shared client session and the health poller live exactly as long as the app."""
    st = app[STATE]
    # The node credential rides on every call, health checks included.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=app[auth.NODE_HEADERS])
    st.orchestrator = Orchestrator(st.settings, session, st.pool,
                                   lambda model_id, ids: st.tokenizers[model_id].decode(ids))
    # One round before serving, so the first request does not see every node as down.
    await st.pool.poll_once(session)
    poller = asyncio.create_task(st.pool.run(session), name="gateway-health-poller")
    try:
        yield
    finally:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        st.orchestrator = None
        await session.close()


def create_app(settings: Settings) -> web.Application:
    """Build the gateway app for `settings`; raises kv_bridge.config.ConfigError for a bad model folder or an
    unreadable auth file."""
    tokenizers = {m.id: ChatTokenizer.from_folder(resolve_model_path(m)) for m in settings.models}
    m = Metrics()
    state = GatewayState(settings, tokenizers, m, NodePool(settings.nodes, m, settings.gateway.health_interval_s))
    client_auth = auth.client_auth(settings.auth)  # outermost: a caller without a key reaches nothing else
    auth.warn_exposure(settings, has_keys=client_auth is not None)
    middlewares = [openai_errors] if client_auth is None else [client_auth, openai_errors]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app[auth.NODE_HEADERS] = auth.node_headers(settings.auth)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)  # ids may hold slashes (aliases)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    ollama.add_routes(app)
    return app


def serve(settings: Settings) -> None:
    """Run the gateway on settings.gateway.host:port until SIGINT/SIGTERM."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    host, port = settings.gateway.host, settings.gateway.port
    log.info("gateway serving %s on http://%s:%d", [m.id for m in settings.models], host, port)
    web.run_app(app, host=host, port=port, print=None, access_log=logging.getLogger("gateway.access"))
