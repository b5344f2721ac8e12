"""POST /v1/messages and /v1/messages/count_tokens: translate, run through the chat path's orchestrator and relay,
answer as an Anthropic `message` (gateway.api.anthropic.framing)."""

from __future__ import annotations

from aiohttp import web

from gateway.api.blocks import Blocks
from gateway.api.chat_job import ChatJob, encode, serve_chat
from gateway.metrics import RequestRecord
from gateway.api.protocol import parse, read_body
from gateway.api.serving import STATE, GatewayState, endpoint

from gateway.api.anthropic.framing import AnthropicFraming
from gateway.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.api.anthropic.translate import chat_request


def _chat(st: GatewayState, req: CountTokensRequest):
    """The chat request; system-role messages stay in place where the model's template renders them there."""
    tok = st.tokenizers[st.route(req.model).id]
    inline = not any(m.role == "system" for m in req.messages) or tok.renders_inline_system
    return chat_request(req, inline)


async def _messages(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    req = parse(MessagesRequest, await read_body(request))
    chat = _chat(st, req)

    def framing(job: ChatJob) -> AnthropicFraming:
        blocks = Blocks(job.reasoning, job.tools, chat.tools)
        return AnthropicFraming(req.model, blocks, len(job.prompt.ids), chat.stop_list(), job.tok.decode)

    return await serve_chat(request, st, rec, chat, framing, stream=bool(req.stream), think=req.think())


messages = endpoint(_messages)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's length as the model's template and tokenizer make it; nothing is generated."""
    st = request.app[STATE]
    req = parse(CountTokensRequest, await read_body(request))
    _, ids = await encode(st, _chat(st, req), req.think())
    return web.json_response({"input_tokens": len(ids)})
