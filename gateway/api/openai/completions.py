"""POST /v1/completions (the legacy text-completion API): a raw prompt, no chat template. The prompt is a string,
a list of token ids, or a list holding one of those; `echo` and `suffix` are refused.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from aiohttp import web

from gateway.metrics import RequestRecord
from gateway.api.openai.render import CompletionRenderer, OpenAIFraming
from gateway.api.openai.protocol import DEFAULT_COMPLETION_MAX_TOKENS, parse_completion_request, resolve_max_tokens
from gateway.api.protocol import read_body
from gateway.api.serving import GatewayState, endpoint, run, sampling_for
from gateway.cluster.upstream import Prompt, UpstreamInput


async def _completions(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    req = parse_completion_request(await read_body(request))
    route = st.route(req.model)
    rec.model = route.id
    tok = st.tokenizers[route.id]
    req.check(tok.vocab_size)
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        ids = await asyncio.get_running_loop().run_in_executor(None, tok.encode_prompt, prompt)
        inp = UpstreamInput.text(prompt)
    else:
        ids, inp = list(prompt), None  # token-id prompts cannot go upstream: another model has another vocabulary
    max_tokens = resolve_max_tokens(req, len(ids), route.max_model_len, default=DEFAULT_COMPLETION_MAX_TOKENS,
                                    param="prompt")
    sampling = replace(sampling_for(req, max_tokens, req.logprobs), grammar=req.grammar())
    renderer = CompletionRenderer(req.model, st.pieces(route.id), req.include_usage(), req.logprobs is not None)
    return await run(request, st, rec, route, Prompt(ids, inp), sampling, req.choices(), bool(req.stream),
                     OpenAIFraming(renderer))


completions = endpoint(_completions)
