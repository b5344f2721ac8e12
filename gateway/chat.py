"""POST /v1/chat/completions: validate, template, check the context budget, then relay one generation as a JSON
completion or as server-sent chat.completion.chunk events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from kv_bridge.config import ModelRoute, Settings

from .errors import APIError, ClientDisconnected, InvalidRequest, ModelNotFound, status_class
from .metrics import Metrics, RequestRecord
from .nodes import NodePool
from .orchestrator import Generation, Orchestrator, Sampling
from .schemas import (ChatRequest, ChunkBuilder, completion_body, parse_chat_request, parse_json,
                      resolve_max_tokens, usage)
from .tokenizer import ChatTokenizer

log = logging.getLogger("gateway.chat")


@dataclass
class GatewayState:
    """Everything the handlers share; `orchestrator` exists between app startup and cleanup."""

    settings: Settings
    tokenizers: dict[str, ChatTokenizer]
    metrics: Metrics
    pool: NodePool
    orchestrator: Orchestrator | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def route(self, model: str) -> ModelRoute:
        route = self.settings.route(model)
        if route is None:
            raise ModelNotFound(f"The model {model!r} does not exist; see GET /v1/models", param="model")
        return route


STATE = web.AppKey("disagg_gateway_state", GatewayState)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    rec = st.metrics.request()
    status = "5xx"
    try:
        resp = await _chat(request, st, rec)
        status = "ok"
        return resp
    except ClientDisconnected:
        status = "cancelled"
        raise
    except APIError as e:
        status = status_class(e.status)
        raise
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    finally:
        rec.finish(status)  # a no-op when the stream already recorded its own outcome


async def _chat(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise InvalidRequest("request body is too large", status=413, code="request_too_large") from None
    req = parse_chat_request(parse_json(raw))
    route = st.route(req.model)
    rec.model = route.id
    # Tokenizing a long prompt takes milliseconds; keep it off the event loop (tokenizers releases the GIL).
    loop = asyncio.get_running_loop()
    prompt = await loop.run_in_executor(None, st.tokenizers[route.id].encode_chat, req.messages_as_dicts())
    sampling = Sampling(
        max_tokens=resolve_max_tokens(req, len(prompt), route.max_model_len),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=req.stop_list(),
    )
    assert st.orchestrator is not None, "app not started"
    rec.started(route.id)
    gen = await st.orchestrator.start(route, prompt, sampling)
    rec.path = gen.planned_path
    try:
        if req.stream:
            return await _stream(request, req, gen, rec)
        return await _complete(request, req, gen, rec)
    finally:
        await gen.close()


def _ids() -> tuple[str, int]:
    return f"chatcmpl-{uuid.uuid4().hex}", int(time.time())


async def _complete(request: web.Request, req: ChatRequest, gen: Generation, rec: RequestRecord) -> web.Response:
    parts = []
    async for tok in gen.tokens():
        rec.token()
        parts.append(tok.text)
        if request.transport is None or request.transport.is_closing():
            # Nobody will read the answer: stop, and closing the decode stream stops the node too.
            raise ClientDisconnected("client closed the connection")
    await gen.close()  # settles the prefill call, whose wall time goes into the headers
    done = gen.done
    assert done is not None
    rec.path = gen.path
    rec.generation_done(done, gen.prefill_s)
    cid, created = _ids()
    use = usage(done.prompt_tokens, done.completion_tokens)
    body = completion_body(cid, created, req.model, "".join(parts), done.finish_reason, use)
    return web.json_response(body, headers=gen.headers())


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _stream(request: web.Request, req: ChatRequest, gen: Generation, rec: RequestRecord) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "x-disagg-path": gen.planned_path,
            "x-disagg-decode-node": gen.decode.name,
        }
    )
    try:
        await resp.prepare(request)
    except ConnectionResetError:
        status = "cancelled"
    else:
        status = await _relay(resp, req, gen, rec)
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    # The client has its answer; now settle the prefill call (for its metric) and close the upstream stream.
    await gen.close()
    rec.path = gen.path
    if status == "ok" and gen.done is not None:
        rec.generation_done(gen.done, gen.prefill_s)
    rec.finish(status)
    return resp


async def _relay(resp: web.StreamResponse, req: ChatRequest, gen: Generation, rec: RequestRecord) -> str:
    """Write the whole event stream; return the outcome label. Nothing raised here may escape: headers are sent."""
    cid, created = _ids()
    chunks = ChunkBuilder(cid, created, req.model, req.include_usage())
    try:
        await resp.write(_sse(chunks.role()))
        async for tok in gen.tokens():
            rec.token()
            if tok.text:  # a token that ends mid-codepoint has no text yet; the next one carries it
                await resp.write(_sse(chunks.content(tok.text)))
        done = gen.done
        assert done is not None
        await resp.write(_sse(chunks.finish(done.finish_reason)))
        if chunks.include_usage:
            await resp.write(_sse(chunks.usage(usage(done.prompt_tokens, done.completion_tokens))))
        await resp.write(_sse("[DONE]"))
        return "ok"
    except ConnectionResetError:
        log.info("client went away during %s; closing the decode stream", gen.request_id)
        return "cancelled"
    except APIError as e:
        log.warning("stream %s failed: %s", gen.request_id, e.message)
        await _write_error(resp, e)
        return "error"
    except Exception:
        log.exception("stream %s failed", gen.request_id)
        await _write_error(resp, APIError("internal error while streaming; see gateway logs"))
        return "error"


async def _write_error(resp: web.StreamResponse, err: APIError) -> None:
    with contextlib.suppress(ConnectionResetError):
        await resp.write(_sse(err.body()))
        await resp.write(_sse("[DONE]"))
