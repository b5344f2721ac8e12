"""OpenAI's app, mounted at /v1: chat completions, completions, models (serving.py) and the Responses API
(responses/), answering errors in OpenAI's shape with the gateway's key check (gateway.api.boundary)."""

from __future__ import annotations

from aiohttp import web

from gateway.api import boundary
from gateway.api.openai import serving
from gateway.api.openai.errors import OPENAI
from gateway.api.openai.responses import api_router as responses
from gateway.api.serving import STATE, GatewayState
from gateway.auth import APIKeys

PROBES: tuple = ()  # root routes a caller without a key may use when health is not protected


def api_app(st: GatewayState, keys: APIKeys | None) -> web.Application:
    app = web.Application(middlewares=boundary.middlewares(OPENAI, keys))
    app[STATE] = st
    app.router.add_post("/chat/completions", serving.chat_completions)
    app.router.add_post("/completions", serving.completions)
    app.router.add_get("/models", serving.list_models)
    app.router.add_get("/models/{model:.+}", serving.get_model)  # ids may hold slashes (aliases)
    responses.add_routes(app)
    return app


def mount(root: web.Application, st: GatewayState, keys: APIKeys | None) -> None:
    root.add_subapp("/v1", api_app(st, keys))
