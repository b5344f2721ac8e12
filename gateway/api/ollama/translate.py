"""Ollama's /api/generate and /api/chat into the shared request (gateway.api.chat_job): a `ChatRequest` (a raw
generate: a `CompletionRequest`), its options as sampling fields with Ollama's defaults, its `num_ctx` and
`num_predict` as the token budget, worded as Ollama words it."""

from __future__ import annotations

import re
from typing import Any

from gateway.api.chat_job import Budget, ChatJob, prepare, prepare_text, reasoning_of
from gateway.api.ollama.protocol import ChatBody, ChatMessage, GenerateBody, Job, Options, _Body
from gateway.api.openai.protocol import ChatRequest, CompletionRequest
from gateway.api.protocol import parse
from gateway.api.serving import GatewayState
from gateway.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound
from gateway.text.output import OutputParser
from kv_bridge.config.models import ModelRoute

# Ollama's documented defaults. Its repeat_penalty default (1.1) is not applied unless asked for: it would make
# greedy answers differ from the OpenAI path and from vLLM's and MLX's own generation.
DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_TOP_K = 0.8, 0.9, 40
_ZERO_DURATION = re.compile(r"0+(\.0*)?(ns|us|µs|ms|s|m|h)?")
_HISTORY_FIELDS = ("thinking", "tool_calls", "tool_name")  # Ollama's message fields a template reads


def find_route(st: GatewayState, name: str) -> ModelRoute:
    """Ollama names: `smollm2` and `smollm2:latest` are the same model."""
    candidates = [name]
    if ":" not in name.rsplit("/", 1)[-1]:
        candidates.append(f"{name}:latest")
    elif name.endswith(":latest"):
        candidates.append(name[: -len(":latest")])
    for candidate in candidates:
        route = st.settings.route(candidate)
        if route is not None:
            return route
    raise ModelNotFound(f"model '{name}' not found", param="model")


class OllamaBudget(Budget):
    """num_ctx is clamped to the model's max_model_len; num_predict <= 0 (Ollama's default) fills the context."""

    def refuse(self, prompt_tokens: int, requested: int | None, limit: int) -> ContextLengthExceeded:
        if requested is None or limit - prompt_tokens < 1:
            return ContextLengthExceeded(
                f"the prompt is {prompt_tokens} tokens, which leaves no room in the context window of {limit} "
                "tokens (num_ctx); shorten the prompt")
        return ContextLengthExceeded(
            f"the prompt ({prompt_tokens} tokens) plus num_predict ({requested}) exceeds the context window of "
            f"{limit} tokens (num_ctx); lower num_predict or shorten the prompt")


def _sampling(o: Options | None) -> tuple[dict, dict]:
    """Options as the shared request's fields: (those its bounds check, Ollama's wider ones: any temperature, any
    number of stop strings)."""
    o = o or Options()
    temperature = DEFAULT_TEMPERATURE if o.temperature is None else o.temperature
    top_p = DEFAULT_TOP_P if o.top_p is None else o.top_p
    if top_p == 0.0:  # keeps only the most likely token: greedy
        temperature, top_p = 0.0, 1.0
    stop = [o.stop] if isinstance(o.stop, str) else list(o.stop or [])
    checked = {"top_p": top_p, "top_k": DEFAULT_TOP_K if o.top_k is None else max(o.top_k, 0),
               "seed": o.seed if o.seed is not None and o.seed >= 0 else None, "min_p": o.min_p,
               "repetition_penalty": o.repeat_penalty, "presence_penalty": o.presence_penalty,
               "frequency_penalty": o.frequency_penalty,
               "max_tokens": o.num_predict if o.num_predict is not None and o.num_predict > 0 else None}
    return checked, {"temperature": temperature, "stop": [s for s in stop if s]}


def _response_format(fmt: str | dict | None) -> dict | None:
    """Ollama's format: "json" is any JSON object, a dict is a JSON schema."""
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"schema": fmt}}
    return {"type": "json_object"} if fmt == "json" else None


def _request(model: type[ChatRequest | CompletionRequest], body: _Body, fields: dict) -> Any:
    checked, wider = _sampling(body.options)
    fields = {**fields, **checked, "response_format": _response_format(body.format)}
    req = parse(model, {k: v for k, v in fields.items() if v is not None})
    return req.model_copy(update=wider)  # past the OpenAI limits; the decode node checks its own


def _refuse_unsupported(body: _Body, images: bool) -> None:
    """Ollama answers 400 when a model lacks a capability; a format we cannot enforce is refused, not ignored."""
    if body.format not in (None, "", "json") and not isinstance(body.format, dict):
        raise InvalidRequest(f'invalid format: {body.format!r}: use "json" or a JSON schema object', param="format")
    if images:
        raise InvalidRequest(f'"{body.model}" does not support images', param="images")


def _think(st: GatewayState, body: _Body, model_id: str) -> bool | str | None:
    """`think` for the template; on a model that does not reason it is Ollama's 400."""
    if body.think and reasoning_of(st, model_id)[1] is None:
        raise InvalidRequest(f'"{body.model}" does not support thinking', param="think")
    return "high" if body.think == "max" else body.think  # Ollama's clients send "max" for the highest effort


def _is_unload(keep_alive: float | str | None) -> bool:
    if isinstance(keep_alive, str):
        return _ZERO_DURATION.fullmatch(keep_alive.strip()) is not None
    return keep_alive is not None and keep_alive == 0


def _message(m: ChatMessage) -> dict:
    """A chat message as Ollama takes it: an assistant's thinking and tool_calls (their arguments are objects) and
    a tool result's tool_name go along; gateway.text.history maps them to what templates read."""
    extra = m.model_extra or {}
    return {"role": m.role, "content": m.content or "",
            **{k: extra[k] for k in _HISTORY_FIELDS if extra.get(k) is not None}}


def _job(job: Job, chat: ChatJob, tools: list | None) -> Job:
    job.prompt, job.upstream, job.sampling = chat.prompt.ids, chat.prompt.upstream, chat.sampling
    if chat.reasoning or chat.tools:
        job.output = OutputParser(chat.reasoning, chat.tools, tools)
    return job


async def generate_job(st: GatewayState, body: GenerateBody, vocab: int | None) -> Job:
    route = find_route(st, body.model)
    _refuse_unsupported(body, bool(body.images))
    if body.suffix:
        raise InvalidRequest(f'"{body.model}" does not support insert', param="suffix")
    if body.template:
        raise InvalidRequest("template overrides are not supported: the model's own chat template is used",
                             param="template")
    job = Job("generate", body.model, route, body.stream is not False, context=not body.raw)
    if not body.prompt and not body.system:
        job.load_reason = "unload" if _is_unload(body.keep_alive) else "load"
        return job
    budget = OllamaBudget(where="prompt", window=(body.options or Options()).num_ctx)
    if body.raw:  # the prompt is the model's input as written: no template, no special tokens added
        req = _request(CompletionRequest, body, {"model": route.id, "prompt": body.prompt or ""})
        _, prompt, job.sampling = await prepare_text(st, req, budget, special_tokens=False)
        job.prompt, job.upstream = prompt.ids, prompt.upstream
        return job
    msgs = [{"role": "system", "content": body.system}] if body.system else []
    msgs.append({"role": "user", "content": body.prompt or ""})
    req = _request(ChatRequest, body, {"model": route.id, "messages": msgs})
    context = _check_context(body.context or [], vocab)
    return _job(job, await prepare(st, req, _think(st, body, route.id), budget, context), None)


def _check_context(ids: list[int], vocab: int | None) -> list[int]:
    """`context` from an earlier answer is token ids; out-of-vocabulary ids never reach a node."""
    bad = [i for i in ids if i < 0 or (vocab and i >= vocab)]
    if bad:
        raise InvalidRequest(f"invalid context: token id {bad[0]} is outside the vocabulary (size {vocab})",
                             param="context")
    return list(ids)


async def chat_job(st: GatewayState, body: ChatBody) -> Job:
    route = find_route(st, body.model)
    _refuse_unsupported(body, any(m.images for m in body.messages or []))
    job = Job("chat", body.model, route, body.stream is not False)
    if not body.messages:
        job.load_reason = "unload" if _is_unload(body.keep_alive) else "load"
        return job
    req = _request(ChatRequest, body, {"model": route.id, "messages": [_message(m) for m in body.messages],
                                       "tools": body.tools})
    think = _think(st, body, route.id)
    return _job(job, await prepare(st, req, think, OllamaBudget(window=(body.options or Options()).num_ctx)),
                body.tools)
