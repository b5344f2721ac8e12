"""What the API handlers share: the gateway state, the per-request metrics wrapper, and `run`:
n choices of one prompt through the orchestrator, answered by gateway.api.relay in the API's framing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

from aiohttp import web

from kv_bridge.config.models import ModelRoute
from kv_bridge.config.settings import Settings
from kv_bridge.protocol import SPECULATIVE_HEADER, ProtocolError, Sampling, speculative_from_header

from gateway.api import relay
from gateway.errors import APIError, ClientDisconnected, InvalidRequest, ModelNotFound, status_class
from gateway.metrics import Metrics, RequestRecord
from gateway.cluster.fidelity import Fidelity
from gateway.cluster.nodes import NodePool
from gateway.cluster.orchestrator import Choices, Orchestrator, per_choice
from gateway.cluster.queue import Waiting
from gateway.text.reasoning import gate_grammar, parser_name
from gateway.api.relay import Framing
from gateway.api.openai.framing import TokenPieces
from gateway.text.tokenizer import ChatTokenizer
from gateway.cluster.upstream import Prompt

log = logging.getLogger("gateway.api.serving")


@dataclass
class GatewayState:
    """Everything the handlers share; `orchestrator` exists between app startup and cleanup."""

    settings: Settings
    tokenizers: dict[str, ChatTokenizer]
    metrics: Metrics
    pool: NodePool
    orchestrator: Orchestrator | None = None
    fidelity: Fidelity | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _pieces: dict[str, TokenPieces] = field(default_factory=dict)

    def route(self, model: str) -> ModelRoute:
        route = self.settings.route(model)
        if route is None:
            raise ModelNotFound(f"The model {model!r} does not exist; see GET /v1/models", param="model")
        return route

    def pieces(self, model_id: str) -> TokenPieces:
        if model_id not in self._pieces:
            self._pieces[model_id] = TokenPieces(self.tokenizers[model_id].tokenizer)
        return self._pieces[model_id]


STATE = web.AppKey("disagg_gateway_state", GatewayState)
Work = Callable[[web.Request, GatewayState, RequestRecord], Awaitable[web.StreamResponse]]


def endpoint(work: Work) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler around `work` that counts the request exactly once with its outcome."""

    async def handler(request: web.Request) -> web.StreamResponse:
        st = request.app[STATE]
        rec = st.metrics.request()
        status = "5xx"
        try:
            resp = await work(request, st, rec)
            status = "ok"
            return resp
        except (ClientDisconnected, asyncio.CancelledError):
            status = "cancelled"
            raise
        except APIError as e:
            status = status_class(e.status)
            raise
        finally:
            rec.finish(status)  # a no-op when the stream already recorded its own outcome

    return handler


async def run(request: web.Request, st: GatewayState, rec: RequestRecord, route: ModelRoute, prompt: Prompt,
              sampling: Sampling, n: int, stream: bool, framing: Framing) -> web.StreamResponse:
    """Generate n choices of `prompt` and answer with them, framed for the client's API."""
    assert st.orchestrator is not None, "app not started"
    try:  # the client's speculation switch, forwarded to the decode node (kv_bridge.protocol SPECULATIVE_HEADER)
        sampling = replace(sampling, speculative=speculative_from_header(request.headers.get(SPECULATIVE_HEADER)))
    except ProtocolError as e:
        raise InvalidRequest(str(e)) from None
    if sampling.grammar is not None:  # structured output starts after the reasoning (gateway.text.reasoning.gate_grammar)
        tok = st.tokenizers[route.id]
        tail = tok.decode(prompt.ids[-8:], skip_special_tokens=False)
        sampling = replace(sampling, grammar=gate_grammar(sampling.grammar,
                                                          parser_name(route.reasoning_parser, tok.model_type), tail))
    # A busy model makes the request wait in the gateway's queue: it leaves when its client goes, and a stream opens
    # at once (gateway.api.relay.EarlyStream).
    early = relay.EarlyStream(request, framing) if stream else None
    waiting = Waiting(gone=lambda: request.transport is None or request.transport.is_closing(),
                      queued=early.open if early is not None else None)
    choices = Choices(st.orchestrator, route, prompt, per_choice(sampling, n), waiting)
    rec.arrived(route.id)
    try:
        await choices.start()
    except APIError as e:
        if early is None or early.resp is None:
            raise
        return await early.fail(e, rec)
    rec.started(route.id)  # disagg_requests_running counts it from here, not while it waited
    rec.path = choices.first.planned_path
    try:
        if stream:
            return await relay.stream(request, choices, framing, rec, early.resp if early is not None else None)
        return await relay.complete(request, choices, framing, rec)
    finally:
        await choices.close()
