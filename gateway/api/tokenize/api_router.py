"""vLLM's /tokenize and /detokenize, at the root as in vLLM, answering errors in the root app's (OpenAI's) shape."""

from __future__ import annotations

from aiohttp import web

from gateway.api.serving import GatewayState
from gateway.api.tokenize import serving
from gateway.auth import APIKeys

PROBES: tuple = ()  # root routes a caller without a key may use when health is not protected


def mount(root: web.Application, st: GatewayState, keys: APIKeys | None) -> None:
    root.router.add_post("/tokenize", serving.tokenize)
    root.router.add_post("/detokenize", serving.detokenize)
