"""The Responses API's routes, on the OpenAI app (mounted at /v1), with its store."""

from __future__ import annotations

from aiohttp import web

from gateway.api.openai.responses.serving import create_response, get_response
from gateway.api.openai.responses.store import STORE, ResponseStore


def add_routes(app: web.Application, store: ResponseStore | None = None) -> None:
    app[STORE] = store or ResponseStore()
    app.router.add_post("/responses", create_response)
    app.router.add_get("/responses/{response_id}", get_response)
