"""The one request path's first half: a request made ready to run (route, templated prompt, token budget, sampling,
output parsers' names). Every API translates into a `ChatRequest` (or a `CompletionRequest`) and comes here:
/v1/chat/completions and /v1/completions as they are, /v1/responses, /v1/messages and Ollama's /api/* translated."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Callable

from aiohttp import web

from kv_bridge.config.models import ModelRoute
from kv_bridge.protocol import Sampling

from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.text.output import tool_parser_name
from gateway.text.reasoning import parser_name, template_kwargs
from gateway.api.openai.protocol import ChatRequest, CompletionRequest, GenerationRequest
from gateway.api.relay import Framing
from gateway.api.serving import GatewayState, run
from gateway.metrics import RequestRecord
from gateway.text.tokenizer import ChatTokenizer
from gateway.text.toolcalls.forced import forced_call_grammar
from gateway.cluster.upstream import Prompt, UpstreamInput

# Sampling fields beyond an API's own, taken as vLLM's servers take them (clients send them as extra body).
EXTRA_SAMPLING = ("top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "logit_bias")


@dataclass(frozen=True)
class Budget:
    """The generation's token budget. Without a requested length a request may fill the context, as vLLM allows
    (SDKs and curl omit it; a reasoning model needs the room), or take `default` (the legacy completions API's),
    shrunk to what fits. `window`: a smaller context the client asked for (Ollama's num_ctx). `where`: the prompt's
    field, the refusal's param. An API words its refusal by overriding `refuse`."""

    where: str = "messages"
    default: int | None = None
    window: int | None = None

    def max_tokens(self, requested: int | None, prompt_tokens: int, max_model_len: int) -> int:
        """The length to generate; a request that cannot fit is refused before any work."""
        limit = min(self.window or max_model_len, max_model_len)
        room = limit - prompt_tokens
        if requested is None and room >= 1:
            return room if self.default is None else min(self.default, room)
        if requested is not None and requested <= room:
            return requested
        raise self.refuse(prompt_tokens, requested, limit)

    def refuse(self, prompt_tokens: int, requested: int | None, limit: int) -> ContextLengthExceeded:
        """OpenAI's (and vLLM's) wording."""
        requested = requested or self.default or 1
        where = "the messages" if self.where == "messages" else "the prompt"
        return ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in {where}, {requested} in the completion). "
            f"Please reduce the length of {where} or completion.", param=self.where)


CHAT = Budget()


def sampling_for(req: GenerationRequest, max_tokens: int, logprobs: int | None) -> Sampling:
    """The decode node's sampling for a validated request; OpenAI's defaults where a field is absent."""
    def pick(value, default):
        return default if value is None else value

    return Sampling(
        max_tokens=max_tokens, temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0), seed=req.seed,
        stop=req.stop_list(), top_k=pick(req.top_k, 0), min_p=pick(req.min_p, 0.0),
        presence_penalty=pick(req.presence_penalty, 0.0), frequency_penalty=pick(req.frequency_penalty, 0.0),
        repetition_penalty=pick(req.repetition_penalty, 1.0),
        logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()}, logprobs=logprobs,
    )


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


async def _off_loop(fn, *args) -> list[int]:
    # Tokenizing a long prompt takes milliseconds; keep it off the event loop (tokenizers releases the GIL).
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def encode(st: GatewayState, req: ChatRequest, think: bool | str | None = None) -> tuple[ModelRoute, list[int]]:
    """The route and the templated prompt's ids. `think`: Anthropic's thinking switch or Ollama's `think` (None: the
    template's own default, or what `req.reasoning_effort` says: vLLM's "none" switches thinking off)."""
    route, reasoning = reasoning_of(st, req.model)
    tok = st.tokenizers[route.id]
    req.check(tok.vocab_size, tok.supports_tools)
    effort, effort_think = req.effort()
    try:
        kwargs = {**template_kwargs(reasoning or "", effort, effort_think if think is None else think),
                  **(req.chat_template_kwargs or {})}
    except ValueError as e:
        raise InvalidRequest(str(e), param="reasoning") from None
    ids = await _off_loop(tok.encode_chat, req.messages_as_dicts(), req.tools or None, kwargs)
    if not ids:
        raise InvalidRequest("the prompt is empty after templating", param="messages")
    return route, ids


async def prepare(st: GatewayState, req: ChatRequest, think: bool | str | None = None, budget: Budget = CHAT,
                  context: list[int] | tuple = ()) -> ChatJob:
    """Everything a chat request decides before it runs, for every API. `context`: token ids the prompt continues
    (Ollama's generate `context`: our ids, which an upstream model cannot read, so such a request stays here)."""
    route, ids = await encode(st, req, think)
    ids = [*context, *ids]
    tok = st.tokenizers[route.id]
    reasoning = parser_name(route.reasoning_parser, tok.model_type)
    # An upstream gets the messages; tools it would not see, so such requests stay in the cluster.
    inp = None if req.tools or context else UpstreamInput.chat(req.client_messages(), reasoning)
    max_tokens = budget.max_tokens(req.max_completion_tokens or req.max_tokens, len(ids), route.max_model_len)
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


async def serve_chat(request: web.Request, st: GatewayState, rec: RequestRecord, req: ChatRequest,
                     framing: Callable[[ChatJob], Framing], *, stream: bool, n: int = 1,
                     think: bool | str | None = None) -> web.StreamResponse:
    """The rest of a chat handler, for every API that answers what it asked at once: the request counted under its
    model, prepared, run, and answered in the `framing` made for its job."""
    rec.model = st.route(req.model).id
    job = await prepare(st, req, think)
    return await run(request, st, rec, job.route, job.prompt, job.sampling, n, stream, framing(job))


async def prepare_text(st: GatewayState, req: CompletionRequest, budget: Budget,
                       special_tokens: bool = True) -> tuple[ModelRoute, Prompt, Sampling]:
    """A raw prompt, no chat template (/v1/completions; Ollama's raw generate, whose prompt already holds every
    special token: `special_tokens` False)."""
    route = st.route(req.model)
    tok = st.tokenizers[route.id]
    req.check(tok.vocab_size)
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        ids = await _off_loop(tok.encode_prompt if special_tokens else tok.encode, prompt)
        inp = UpstreamInput.text(prompt)
    else:
        ids, inp = list(prompt), None  # token-id prompts cannot go upstream: another model has another vocabulary
    if not ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    max_tokens = budget.max_tokens(req.max_completion_tokens or req.max_tokens, len(ids), route.max_model_len)
    sampling = replace(sampling_for(req, max_tokens, req.logprobs), grammar=req.grammar())
    return route, Prompt(ids, inp), sampling
