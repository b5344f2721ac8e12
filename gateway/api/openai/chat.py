"""POST /v1/chat/completions: validate, apply the chat template (with tools when the template renders them),
check the context budget, then relay n choices as a `chat.completion` or as `chat.completion.chunk` events.
"""

from __future__ import annotations

from aiohttp import web

from gateway.api.chat_job import prepare
from gateway.api.openai.protocol import parse_chat_request
from gateway.api.openai.render import ChatRenderer, OpenAIFraming
from gateway.api.protocol import read_body
from gateway.api.serving import STATE, GatewayState, endpoint, run
from gateway.metrics import RequestRecord

__all__ = ["STATE", "GatewayState", "chat_completions"]


async def _chat(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    req = parse_chat_request(await read_body(request))
    rec.model = st.route(req.model).id
    job = await prepare(st, req)
    renderer = ChatRenderer(req.model, st.pieces(job.route.id), req.include_usage(), bool(req.logprobs),
                            job.reasoning, job.tools, req.tools)
    return await run(request, st, rec, job.route, job.prompt, job.sampling, req.choices(), bool(req.stream),
                     OpenAIFraming(renderer))


chat_completions = endpoint(_chat)
