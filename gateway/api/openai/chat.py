"""POST /v1/chat/completions: validate, apply the chat template (with tools when the template renders them),
check the context budget, then relay n choices as a `chat.completion` or as `chat.completion.chunk` events.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from aiohttp import web

from gateway.errors import InvalidRequest
from gateway.metrics import RequestRecord
from gateway.text.output import tool_parser_name
from gateway.text.reasoning import parser_name, template_kwargs
from gateway.api.openai.render import ChatRenderer, OpenAIFraming
from gateway.api.openai.protocol import parse_chat_request, resolve_max_tokens
from gateway.api.serving import STATE, GatewayState, endpoint, read_body, run, sampling_for
from gateway.text.toolcalls.forced import forced_call_grammar
from gateway.cluster.upstream import Prompt, UpstreamInput

__all__ = ["STATE", "GatewayState", "chat_completions"]


async def _chat(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    req = parse_chat_request(await read_body(request))
    route = st.route(req.model)
    rec.model = route.id
    tok = st.tokenizers[route.id]
    req.check(tok.vocab_size, tok.supports_tools)
    # Tokenizing a long prompt takes milliseconds; keep it off the event loop (tokenizers releases the GIL).
    loop = asyncio.get_running_loop()
    reasoning = parser_name(route.reasoning_parser, tok.model_type)
    kwargs = {**template_kwargs(reasoning or "", *req.effort()), **(req.chat_template_kwargs or {})}
    prompt = await loop.run_in_executor(None, tok.encode_chat, req.messages_as_dicts(), req.tools or None, kwargs)
    # An upstream gets the messages; tools it would not see, so such requests stay in the cluster.
    inp = None if req.tools else UpstreamInput.chat(req.client_messages(), reasoning)
    max_tokens = resolve_max_tokens(req, len(prompt), route.max_model_len)
    tools = tool_parser_name(route.tool_parser, tok.model_type) if req.tools and req.tool_choice != "none" else None
    grammar = req.grammar()
    # the call is masked into the model's own format (gateway/text/toolcalls/forced.py)
    if forced := req.forced_tools():
        try:
            grammar = forced_call_grammar(tools or "", forced, lambda t: tok.tokenizer.token_to_id(t) is not None)
        except ValueError as e:
            raise InvalidRequest(str(e), param="tool_choice") from None
    sampling = replace(sampling_for(req, max_tokens, req.top_alternatives()), grammar=grammar)
    renderer = ChatRenderer(req.model, st.pieces(route.id), req.include_usage(), bool(req.logprobs), reasoning,
                            tools, req.tools)
    return await run(request, st, rec, route, Prompt(prompt, inp), sampling, req.choices(), bool(req.stream),
                     OpenAIFraming(renderer))


chat_completions = endpoint(_chat)
