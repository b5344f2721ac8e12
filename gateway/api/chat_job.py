"""A chat request made ready to run: route, templated prompt, sampling and the output parsers' names. What
/v1/responses and /v1/messages share; each translates its own request into a `ChatRequest` first."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from kv_bridge.config import ModelRoute
from kv_bridge.protocol import Sampling

from gateway.errors import InvalidRequest
from gateway.text.output import tool_parser_name
from gateway.text.reasoning import parser_name, template_kwargs
from gateway.api.openai.protocol import ChatRequest, resolve_max_tokens
from gateway.api.serving import GatewayState, sampling_for
from gateway.text.tokenizer import ChatTokenizer
from gateway.text.toolcalls.forced import forced_call_grammar
from gateway.cluster.upstream import Prompt, UpstreamInput

# Sampling fields beyond an API's own, taken as vLLM's servers take them (clients send them as extra body).
EXTRA_SAMPLING = ("top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "logit_bias")


@dataclass
class ChatJob:
    route: ModelRoute
    tok: ChatTokenizer
    prompt: Prompt
    sampling: Sampling
    reasoning: str | None  # reasoning parser name (gateway.text.reasoning), None: no split
    tools: str | None  # tool-call parser name (gateway.text.toolcalls), None: calls stay text


def reasoning_of(st: GatewayState, model: str) -> tuple[ModelRoute, str | None]:
    """The model's route and its reasoning parser's name (None: its output has no reasoning to split)."""
    route = st.route(model)
    return route, parser_name(route.reasoning_parser, st.tokenizers[route.id].model_type)


async def encode(st: GatewayState, req: ChatRequest, think: bool | None = None) -> tuple[ModelRoute, list[int]]:
    """The route and the templated prompt's ids. `think`: Anthropic's thinking switch (None: the template's own
    default, or what `req.reasoning_effort` says: vLLM's "none" switches thinking off)."""
    route, reasoning = reasoning_of(st, req.model)
    tok = st.tokenizers[route.id]
    req.check(tok.vocab_size, tok.supports_tools)
    effort, effort_think = req.effort()
    try:
        kwargs = {**template_kwargs(reasoning or "", effort, effort_think if think is None else think),
                  **(req.chat_template_kwargs or {})}
    except ValueError as e:
        raise InvalidRequest(str(e), param="reasoning") from None
    # Tokenizing a long prompt takes milliseconds; keep it off the event loop (tokenizers releases the GIL).
    ids = await asyncio.get_running_loop().run_in_executor(None, tok.encode_chat, req.messages_as_dicts(),
                                                           req.tools or None, kwargs)
    return route, ids


async def prepare(st: GatewayState, req: ChatRequest, think: bool | None = None) -> ChatJob:
    """Everything a chat request decides before it runs: /v1/chat/completions' own, and each translated one's."""
    route, ids = await encode(st, req, think)
    tok = st.tokenizers[route.id]
    reasoning = parser_name(route.reasoning_parser, tok.model_type)
    # An upstream gets the messages; tools it would not see, so such requests stay in the cluster.
    inp = None if req.tools else UpstreamInput.chat(req.client_messages(), reasoning)
    max_tokens = resolve_max_tokens(req, len(ids), route.max_model_len)
    tools = tool_parser_name(route.tool_parser, tok.model_type) if req.tools and req.tool_choice != "none" else None
    grammar = req.grammar()
    # the call is masked into the model's own format (gateway/text/toolcalls/forced.py)
    if forced := req.forced_tools():
        try:
            grammar = forced_call_grammar(tools or "", forced, lambda t: tok.tokenizer.token_to_id(t) is not None)
        except ValueError as e:
            raise InvalidRequest(str(e), param="tool_choice") from None
    sampling = replace(sampling_for(req, max_tokens, req.top_alternatives()), grammar=grammar)
    return ChatJob(route, tok, Prompt(ids, inp), sampling, reasoning, tools)
