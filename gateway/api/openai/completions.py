"""POST /v1/completions (the legacy text-completion API): a raw prompt, no chat template. The prompt is a string,
a list of token ids, or a list holding one of those; `echo` and `suffix` are refused.
"""

from __future__ import annotations

from aiohttp import web

from gateway.metrics import RequestRecord
from gateway.api.chat_job import Budget, prepare_text
from gateway.api.openai.render import CompletionRenderer, OpenAIFraming
from gateway.api.openai.protocol import DEFAULT_COMPLETION_MAX_TOKENS, parse_completion_request
from gateway.api.protocol import read_body
from gateway.api.serving import GatewayState, endpoint, run

COMPLETION = Budget(where="prompt", default=DEFAULT_COMPLETION_MAX_TOKENS)


async def _completions(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    req = parse_completion_request(await read_body(request))
    rec.model = st.route(req.model).id
    route, prompt, sampling = await prepare_text(st, req, COMPLETION)
    renderer = CompletionRenderer(req.model, st.pieces(route.id), req.include_usage(), req.logprobs is not None)
    return await run(request, st, rec, route, prompt, sampling, req.choices(), bool(req.stream),
                     OpenAIFraming(renderer))


completions = endpoint(_completions)
