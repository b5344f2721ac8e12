"""OpenAI's handlers: POST /v1/chat/completions (validate, template, budget, then n choices as a `chat.completion`
or `chat.completion.chunk` events), POST /v1/completions (the legacy API: a raw prompt, no template; `echo` and
`suffix` refused), GET /v1/models. Responses (/v1/responses) is its own package, responses/."""

from __future__ import annotations

from aiohttp import web

from gateway.api.chat_job import Budget, ChatJob, prepare_text, serve_chat
from gateway.api.openai.framing import ChatRenderer, CompletionRenderer, OpenAIFraming
from gateway.api.openai.protocol import DEFAULT_COMPLETION_MAX_TOKENS, parse_chat_request, parse_completion_request
from gateway.api.protocol import read_body
from gateway.api.serving import STATE, GatewayState, endpoint, run
from gateway.metrics import RequestRecord

COMPLETION = Budget(where="prompt", default=DEFAULT_COMPLETION_MAX_TOKENS)


async def _chat(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    req = parse_chat_request(await read_body(request))

    def framing(job: ChatJob) -> OpenAIFraming:
        return OpenAIFraming(ChatRenderer(req.model, st.pieces(job.route.id), req.include_usage(), bool(req.logprobs),
                                          job.reasoning, job.tools, req.tools))

    return await serve_chat(request, st, rec, req, framing, stream=bool(req.stream), n=req.choices())


async def _completions(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    req = parse_completion_request(await read_body(request))
    rec.model = st.route(req.model).id
    route, prompt, sampling = await prepare_text(st, req, COMPLETION)
    renderer = CompletionRenderer(req.model, st.pieces(route.id), req.include_usage(), req.logprobs is not None)
    return await run(request, st, rec, route, prompt, sampling, req.choices(), bool(req.stream),
                     OpenAIFraming(renderer))


chat_completions = endpoint(_chat)
completions = endpoint(_completions)


async def list_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    data = [_model_card(name, st.created) for m in st.settings.models for name in m.names]  # aliases too
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    st.route(request.match_info["model"])  # an unknown name is a 404 in OpenAI's shape
    return web.json_response(_model_card(request.match_info["model"], st.created))


def _model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "disagg"}
