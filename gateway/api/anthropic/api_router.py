"""Anthropic's app, mounted at /v1/messages: Messages and count_tokens (serving.py), with Anthropic's error shape
and key headers (errors.py)."""

from __future__ import annotations

from aiohttp import web

from gateway.api.anthropic import errors, serving
from gateway.api.serving import STATE, GatewayState
from gateway.auth import APIKeys

PROBES: tuple = ()  # root routes a caller without a key may use when health is not protected


def api_app(st: GatewayState, keys: APIKeys | None) -> web.Application:
    app = web.Application(middlewares=errors.middlewares(keys))
    app[STATE] = st
    app.router.add_post("", serving.messages)
    app.router.add_post("/count_tokens", serving.count_tokens)
    return app


def mount(root: web.Application, st: GatewayState, keys: APIKeys | None) -> None:
    # Before OpenAI's /v1 (gateway/app.py mounts in that order): the longer prefix resolves first.
    root.add_subapp("/v1/messages", api_app(st, keys))
