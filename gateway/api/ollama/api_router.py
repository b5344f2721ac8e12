"""Ollama's app, mounted at /api (errors as `{"error": "..."}`, errors.py), and its root route "/" ("Ollama is
running") on the gateway app: aiohttp mounts no sub-app at "/"."""

from __future__ import annotations

from aiohttp import web

from gateway.api import boundary
from gateway.api.ollama import serving
from gateway.api.ollama.cards import CARDS, build_card
from gateway.api.ollama.errors import OLLAMA
from gateway.api.serving import STATE, GatewayState
from gateway.auth import APIKeys

PROBES = (serving.root,)  # Ollama's liveness probe: open to callers without a key unless health is protected


def api_app(st: GatewayState, keys: APIKeys | None) -> web.Application:
    app = web.Application(middlewares=boundary.middlewares(OLLAMA, keys))
    app[STATE] = st
    app[CARDS] = {m.id: build_card(m) for m in st.settings.models}
    r = app.router
    r.add_get("/version", serving.version)
    r.add_get("/tags", serving.tags)
    r.add_get("/ps", serving.ps)
    r.add_post("/show", serving.show)
    r.add_post("/generate", serving.generate)
    r.add_post("/chat", serving.chat)
    return app


def mount(root: web.Application, st: GatewayState, keys: APIKeys | None) -> None:
    root.router.add_get("/", serving.root)  # add_get answers HEAD too
    root.add_subapp("/api", api_app(st, keys))
