"""POST /v1/responses and GET /v1/responses/{id}: translate, run through the chat path's orchestrator and relay,
answer as a `response` (gateway.api.openai.responses.framing)."""

from __future__ import annotations

from aiohttp import web

from gateway.api.blocks import Blocks
from gateway.api.chat_job import ChatJob, serve_chat
from gateway.metrics import RequestRecord
from gateway.api.protocol import read_body
from gateway.api.serving import GatewayState, endpoint

from gateway.api.openai.responses.framing import ResponsesFraming
from gateway.api.openai.responses.protocol import parse_responses_request
from gateway.api.openai.responses.store import STORE
from gateway.api.openai.responses.translate import chat_request, input_messages


async def _create(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    req = parse_responses_request(await read_body(request))
    store = request.app[STORE]
    history = store.get(req.previous_response_id).messages if req.previous_response_id else []
    chat = chat_request(req, history)

    def framing(job: ChatJob) -> ResponsesFraming:
        return ResponsesFraming(req, Blocks(job.reasoning, job.tools, chat.tools), history + input_messages(req.input),
                                None if req.store is False else store)

    return await serve_chat(request, st, rec, chat, framing, stream=bool(req.stream))


create_response = endpoint(_create)


async def get_response(request: web.Request) -> web.Response:
    """A stored response, as `responses.retrieve` reads it."""
    return web.json_response(request.app[STORE].get(request.match_info["response_id"], "response_id").response)
