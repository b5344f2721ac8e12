"""What the OpenAI endpoints share: the gateway state, the per-request metrics wrapper, and relaying n choices
of one prompt as a JSON body or as server-sent events (rendered by gateway.responses).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web

from kv_bridge.config import ModelRoute, Settings
from kv_bridge.protocol import Sampling

from .errors import APIError, ClientDisconnected, InvalidRequest, ModelNotFound, status_class
from .metrics import Metrics, RequestRecord
from .nodes import NodePool
from .orchestrator import Choices, Orchestrator, per_choice
from .responses import ChatRenderer, ChoiceResult, CompletionRenderer, TokenPieces
from .schemas import GenerationRequest, parse_json, usage
from .tokenizer import ChatTokenizer
from .upstream import Prompt

log = logging.getLogger("gateway.serving")

Renderer = ChatRenderer | CompletionRenderer


@dataclass
class GatewayState:
    """Everything the handlers share; `orchestrator` exists between app startup and cleanup."""

    settings: Settings
    tokenizers: dict[str, ChatTokenizer]
    metrics: Metrics
    pool: NodePool
    orchestrator: Orchestrator | None = None
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


async def read_body(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise InvalidRequest("request body is too large", status=413, code="request_too_large") from None
    return parse_json(raw)


def sampling_for(req: GenerationRequest, max_tokens: int, logprobs: int | None) -> Sampling:
    """The decode node's sampling for a validated request; OpenAI's defaults where a field is absent."""
    def pick(value, default):
        return default if value is None else value

    return Sampling(
        max_tokens=max_tokens, temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0), seed=req.seed,
        stop=req.stop_list(), top_k=pick(req.top_k, 0), min_p=pick(req.min_p, 0.0),
        presence_penalty=pick(req.presence_penalty, 0.0), frequency_penalty=pick(req.frequency_penalty, 0.0),
        repetition_penalty=pick(req.repetition_penalty, 1.0), logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()},
        logprobs=logprobs,
    )


async def run(request: web.Request, st: GatewayState, rec: RequestRecord, route: ModelRoute, prompt: Prompt,
              sampling: Sampling, n: int, stream: bool, renderer: Renderer) -> web.StreamResponse:
    """Generate n choices of `prompt` and answer with them."""
    assert st.orchestrator is not None, "app not started"
    choices = Choices(st.orchestrator, route, prompt, per_choice(sampling, n))
    rec.started(route.id)
    await choices.start()
    rec.path = choices.first.planned_path
    try:
        if stream:
            return await _stream(request, choices, renderer, rec)
        return await _complete(request, choices, renderer, rec)
    finally:
        await choices.close()


def _usage(choices: Choices) -> dict:
    dones = [d for d in choices.dones if d is not None]
    # The prompt is counted once, as OpenAI does for n > 1; completions add up.
    return usage(dones[0].prompt_tokens, sum(d.completion_tokens for d in dones))


def _record(rec: RequestRecord, choices: Choices) -> None:
    rec.path = choices.first.path
    for g in choices.gens:
        if g.done is not None:
            rec.generation_done(g.done, g.prefill_s)


async def _complete(request: web.Request, choices: Choices, renderer: Renderer, rec: RequestRecord) -> web.Response:
    results = [ChoiceResult(i) for i in range(choices.n)]
    async for index, tok in choices.events():
        if tok is None:
            continue
        rec.token()
        results[index].tokens.append(tok)
        if request.transport is None or request.transport.is_closing():
            # Nobody will read the answer: stop, and closing the decode streams stops the nodes too.
            raise ClientDisconnected("client closed the connection")
    await choices.close()  # settles the prefill calls, whose wall time goes into the headers
    for r, done in zip(results, choices.dones):
        assert done is not None
        r.finish_reason = done.finish_reason
    _record(rec, choices)
    return web.json_response(renderer.body(results, _usage(choices)), headers=choices.first.headers())


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _stream(request: web.Request, choices: Choices, renderer: Renderer, rec: RequestRecord) -> web.StreamResponse:
    gen = choices.first
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "x-disagg-path": str(gen.planned_path),
            "x-disagg-decode-node": gen.decode.name,
        }
    )
    try:
        await resp.prepare(request)
    except ConnectionResetError:
        status = "cancelled"
    else:
        status = await _relay(resp, choices, renderer, rec)
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    # The client has its answer; now settle the prefill calls (for their metric) and close the upstream streams.
    await choices.close()
    if status == "ok":
        _record(rec, choices)
    else:
        rec.path = gen.path
    rec.finish(status)
    return resp


async def _relay(resp: web.StreamResponse, choices: Choices, renderer: Renderer, rec: RequestRecord) -> str:
    """Write the whole event stream; return the outcome label. Nothing raised here may escape: headers are sent."""
    try:
        for chunk in renderer.opening(choices.n):
            await resp.write(_sse(chunk))
        async for index, tok in choices.events():
            if tok is None:
                done = choices.gens[index].done
                assert done is not None
                await resp.write(_sse(renderer.finish(index, done.finish_reason)))
                continue
            rec.token()
            chunk = renderer.token(index, tok)
            if chunk is not None:
                await resp.write(_sse(chunk))
        if renderer.include_usage:
            await resp.write(_sse(renderer.usage_chunk(_usage(choices))))
        await resp.write(_sse("[DONE]"))
        return "ok"
    except ConnectionResetError:
        log.info("client went away during %s; closing the decode streams", choices.first.request_id)
        return "cancelled"
    except APIError as e:
        log.warning("stream %s failed: %s", choices.first.request_id, e.message)
        await _write_error(resp, e)
        return "error"
    except Exception:
        log.exception("stream %s failed", choices.first.request_id)
        await _write_error(resp, APIError("internal error while streaming; see gateway logs"))
        return "error"


async def _write_error(resp: web.StreamResponse, err: APIError) -> None:
    with contextlib.suppress(ConnectionResetError):
        await resp.write(_sse(err.body()))
        await resp.write(_sse("[DONE]"))
