"""The gateway app (`create_app`, `serve`): /health, /metrics and /fidelity on the root app, and each client API
mounted by its package's api_router (Anthropic at /v1/messages, OpenAI at /v1, Ollama at /api, vLLM's /tokenize at
the root), each with its own error shape and key check (gateway.api.boundary).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from typing import AsyncIterator

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kv_bridge.config.auth import AuthConfig
from kv_bridge.config.models import resolve_model_path
from kv_bridge.config.settings import Settings
from kv_bridge.config.source import ConfigError

from gateway import auth
from gateway.api import boundary
from gateway.api.anthropic import api_router as anthropic
from gateway.api.ollama import api_router as ollama
from gateway.api.openai import api_router as openai
from gateway.api.tokenize import api_router as tokenize
from gateway.api.openai.errors import OPENAI
from gateway.api.serving import STATE, GatewayState
from gateway.metrics import Metrics
from gateway.cluster.fidelity import Fidelity
from gateway.cluster.nodes import NodePool
from gateway.cluster.orchestrator import Orchestrator
from gateway.text.output import check_parsers
from gateway.text.tokenizer import ChatTokenizer

log = logging.getLogger("gateway")

MAX_BODY_BYTES = 32 << 20  # long prompts are large JSON; aiohttp's 1 MiB default is too small
# The client APIs, one package each, mounted in this order (Anthropic's /v1/messages before OpenAI's /v1: the longer
# prefix resolves first). A new API is its own package and its api_router here.
APIS = (anthropic, openai, ollama, tokenize)


async def health(request: web.Request) -> web.Response:
    """200 when every model has a healthy decode node (prefill is optional: decode can prefill locally)."""
    st = request.app[STATE]
    serving = st.pool.serving(st.settings.models)
    models = [
        {"id": m.id, "decode_up": len(st.pool.healthy(m.decode)), "prefill_up": len(st.pool.healthy(m.prefill))}
        for m in st.settings.models
    ]
    body = {"status": "ok" if serving else "unavailable", "nodes": st.pool.snapshot(), "models": models,
            "fidelity": st.fidelity.snapshot()}
    if st.orchestrator is not None:  # learned rates and prefill admission (docs/routing.md)
        body.update(st.orchestrator.snapshot())
    return web.json_response(body, status=200 if serving else 503)


OPERATORS = web.AppKey("disagg_operators", auth.OperatorKeys)


async def fidelity(request: web.Request) -> web.Response:
    """POST /fidelity[?model=M]: run the KV fidelity canary of every up pair now (of model M) and answer the verdicts
    (gateway/cluster/fidelity.py); an operator's endpoint (auth.OperatorKeys: never a client key), at most every
    [fidelity] recheck_min_s per pair (429 with Retry-After within it). GET /health reads the verdicts freely."""
    request.app[OPERATORS].check(request.headers.get("Authorization"))
    st = request.app[STATE]
    model = request.query.get("model")
    if model is not None:
        model = st.route(model).id
    if st.orchestrator is None:
        raise web.HTTPServiceUnavailable()
    wait = st.fidelity.recheck_wait(model)
    if wait > 0:
        raise auth.OperatorError(f"a KV fidelity re-check of these pairs was forced less than "
                                 f"{st.settings.fidelity.recheck_min_s:g}s ago ([fidelity] recheck_min_s); their "
                                 f"verdicts are in GET /health", status=429, code="too_soon",
                                 headers={"Retry-After": str(math.ceil(wait))})
    return web.json_response({"pairs": await st.fidelity.check_now(st.orchestrator.client.session, model)})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """One shared client session and the health poller live exactly as long as the app."""
    st = app[STATE]
    # The node credential rides on every call, health checks included.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=app[auth.NODE_HEADERS])
    st.orchestrator = Orchestrator(st.settings, session, st.pool,
                                   lambda model_id, ids: st.tokenizers[model_id].decode(ids), st.fidelity.usable,
                                   st.fidelity.demote)
    # One round before serving, so the first request does not see every node as down.
    await st.pool.poll_once(session)
    tasks = [asyncio.create_task(st.pool.run(session), name="gateway-health-poller"),
             asyncio.create_task(st.fidelity.run(session, st.pool.interval), name="gateway-fidelity")]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        st.orchestrator = None
        await session.close()


def _open_handlers(cfg: AuthConfig) -> set:
    """The root routes a caller without a key may use: the liveness probes and /metrics, unless protected."""
    out = {fidelity}  # its own check: an operator's credential, not a client key (auth.OperatorKeys)
    if not cfg.protect_health:
        out |= {health, *(probe for api in APIS for probe in api.PROBES)}  # e.g. Ollama's "/" ("Ollama is running")
    if not cfg.protect_metrics:
        out.add(metrics)
    return out


def create_app(settings: Settings) -> web.Application:
    """Build the gateway app for `settings`; raises kv_bridge.config.source.ConfigError for a bad model folder or an
    unreadable auth file."""
    check_parsers(settings.models)
    tokenizers = {m.id: ChatTokenizer.from_folder(resolve_model_path(m)) for m in settings.models}
    m = Metrics()
    pool = NodePool(settings.nodes, m, settings.gateway.health_interval_s)
    state = GatewayState(settings, tokenizers, m, pool, fidelity=Fidelity(settings, pool, m))
    keys = auth.api_keys(settings.auth)
    auth.warn_exposure(settings, has_keys=keys is not None)
    # The root app's own errors (unknown paths too) answer in OpenAI's shape, as every non-Ollama path always did.
    root_keys = None if keys is None else keys.for_api(settings.auth, "root")
    app = web.Application(middlewares=boundary.middlewares(OPENAI, root_keys, _open_handlers(settings.auth)),
                          client_max_size=MAX_BODY_BYTES)  # the root app reads every body, sub-apps' too
    app[STATE] = state
    app[auth.NODE_HEADERS] = auth.node_headers(settings.auth)
    app[OPERATORS] = auth.OperatorKeys(settings.auth, keys)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/fidelity", fidelity)
    for api in APIS:  # each API's keys let in the networks auth.keyless_networks names for it
        name = api.__name__.split(".")[-2]  # gateway.api.<name>.api_router
        api.mount(app, state, None if keys is None else keys.for_api(settings.auth, name))
    return app


def listen_sockets(settings: Settings) -> list[socket.socket]:
    """A listening socket per gateway address (its port, and Ollama's when gateway.ollama_port is set); raises
    ConfigError naming the address another process holds."""
    out = []
    for host, port in settings.gateway.listen():
        six = ":" in host
        try:
            out.append(socket.create_server((host, port), family=socket.AF_INET6 if six else socket.AF_INET,
                                            backlog=128, dualstack_ipv6=six and host == "::"))
        except OSError as e:
            for s in out:
                s.close()
            ollama = port == settings.gateway.ollama_port
            what = "gateway.ollama_port" if ollama else "gateway.port"
            hint = "Ollama itself still running? stop it (systemctl stop ollama, or quit the Ollama app); " \
                if ollama else ""
            raise ConfigError(f"cannot listen on {host}:{port} ({what}): {e.strerror}; {hint}stop what holds it "
                              f"(ss -ltnp 'sport = :{port}') or change {what}") from None
    return out


def serve(settings: Settings) -> None:
    """Run the gateway on every address of settings.gateway.listen() until SIGINT/SIGTERM."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    socks = listen_sockets(settings)
    log.info("gateway serving %s on %s", [m.id for m in settings.models],
             ", ".join(f"http://{h}:{p}" for h, p in settings.gateway.listen()))
    web.run_app(app, sock=socks, print=None, access_log=logging.getLogger("gateway.access"))
