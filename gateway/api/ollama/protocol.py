"""Ollama request validation for /api/generate and /api/chat, options -> the decode node's `Sampling` (the same one
the OpenAI path sends), and the answer shapes (NDJSON chunks, the final object with timings in nanoseconds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import Field

from kv_bridge.config import ModelRoute
from kv_bridge.protocol import DoneLine as Done
from kv_bridge.protocol import Sampling, json_grammar

from gateway.api.protocol import APIModel, MinP, Penalty, RepetitionPenalty, Temperature, parse, read_body
from gateway.api.serving import GatewayState
from gateway.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound
from gateway.text.history import template_messages
from gateway.text.output import OutputParser, tool_parser_name
from gateway.text.reasoning import parser_name, template_kwargs
from gateway.cluster.upstream import UpstreamInput

# Ollama's documented defaults. Its repeat_penalty default (1.1) is not applied unless asked for: it would make
# greedy answers differ from the OpenAI path and from vLLM's and MLX's own generation.
DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_TOP_K = 0.8, 0.9, 40
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(Sampling)}
_ZERO_DURATION = re.compile(r"0+(\.0*)?(ns|us|µs|ms|s|m|h)?")


class Options(APIModel):
    """The runtime options we map; load-time and llama.cpp-only options (num_gpu, mirostat, ...) are ignored.
    Ollama's own ranges where they are wider: top_p 0 is greedy, top_k <= 0 off, any number of stop strings."""

    num_predict: int | None = None  # <= 0: until the context is full, as in Ollama
    num_ctx: int | None = Field(default=None, ge=1)
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: int | None = None  # <= 0: off
    min_p: MinP | None = None
    seed: int | None = None  # < 0: random, as in Ollama
    stop: str | list[str] | None = None
    repeat_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None


class ChatMessage(APIModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[Any] | None = None


class _Body(APIModel):
    model: str = Field(min_length=1)
    stream: bool | None = None  # absent or null: stream
    format: str | dict | None = None
    options: Options | None = None
    keep_alive: float | str | None = None  # models stay loaded on their nodes; only "0" (unload) is answered
    think: bool | str | None = None


class GenerateBody(_Body):
    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[Any] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None


@dataclass
class Job:
    """One validated request: `prompt` None means a load/unload request, answered without generating."""

    kind: Literal["generate", "chat"]
    name: str  # the model name as the client wrote it; Ollama echoes it back
    route: ModelRoute
    stream: bool
    prompt: list[int] | None = None
    sampling: Sampling | None = None
    upstream: UpstreamInput | None = None  # what an upstream gets instead of `prompt` (None: cannot go there)
    context: bool = False  # answer with `context` (generate, not raw)
    load_reason: str = "load"
    output: OutputParser | None = None  # splits thinking, answer and tool calls; None: all text is the answer


@dataclass
class Clock:
    """Request arrival, generation start, first and last token (monotonic seconds) -> Ollama's ns durations."""

    t0: float
    t_gen: float = 0.0
    t_first: float | None = None
    t_end: float | None = None

    def token(self) -> None:
        if self.t_first is None:
            self.t_first = time.monotonic()

    def durations(self) -> dict[str, int]:
        end = self.t_end or time.monotonic()
        first = self.t_first or end
        t_gen = self.t_gen or self.t0
        ns = lambda s: max(0, int(s * 1e9))  # noqa: E731
        # The model is always resident; the gateway's own preparation (parse, template, tokenize) is the "load".
        return {"total_duration": ns(end - self.t0), "load_duration": ns(t_gen - self.t0),
                "prompt_eval_duration": ns(first - t_gen), "eval_duration": ns(end - first)}


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


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _refuse_unsupported(body: _Body, name: str, images: bool) -> None:
    """Ollama answers 400 when a model lacks a capability; a format we cannot enforce is refused, not ignored."""
    if body.format not in (None, "", "json") and not isinstance(body.format, dict):
        raise InvalidRequest(f'invalid format: {body.format!r}: use "json" or a JSON schema object')
    if images:
        raise InvalidRequest(f'"{name}" does not support images')


def _output(body: _Body, route: ModelRoute, st: GatewayState,
            tools: list | None = None) -> tuple[Any, dict, str | None]:
    """(the request's OutputParser or None, template kwargs for `think`, the reasoning parser's name); `think` on
    a model that does not reason is Ollama's 400."""
    model_type = st.tokenizers[route.id].model_type
    name = parser_name(route.reasoning_parser, model_type)
    if name is None and body.think:
        raise InvalidRequest(f'"{body.model}" does not support thinking')
    tool_name = tool_parser_name(route.tool_parser, model_type) if tools else None
    think = "high" if body.think == "max" else body.think  # Ollama's clients send "max" for the highest effort
    try:
        kwargs = template_kwargs(name, None, think) if name else {}
    except ValueError as e:
        raise InvalidRequest(f"invalid think value: {e}") from None
    if name is None and tool_name is None:
        return None, kwargs, name
    return OutputParser(name, tool_name, tools), kwargs, name


def _grammar(fmt: str | dict | None) -> dict | None:
    """Ollama's format as the protocol's grammar: "json" is any JSON object, a dict is a JSON schema."""
    if isinstance(fmt, dict):
        return json_grammar(fmt)
    return json_grammar() if fmt == "json" else None


def _is_unload(keep_alive: float | str | None) -> bool:
    if isinstance(keep_alive, str):
        return _ZERO_DURATION.fullmatch(keep_alive.strip()) is not None
    return keep_alive is not None and keep_alive == 0


def build_sampling(opts: Options | None, prompt_len: int, route: ModelRoute) -> Sampling:
    """Ollama options -> the decode node's sampling; fields the decode protocol lacks are left out."""
    o = opts or Options()
    temperature = DEFAULT_TEMPERATURE if o.temperature is None else o.temperature
    top_p = DEFAULT_TOP_P if o.top_p is None else o.top_p
    if top_p == 0.0:  # keeps only the most likely token: greedy
        temperature, top_p = 0.0, 1.0
    stop = [o.stop] if isinstance(o.stop, str) else list(o.stop or [])
    values: dict[str, Any] = {
        "max_tokens": _budget(o, prompt_len, route), "temperature": temperature, "top_p": top_p,
        "seed": o.seed if o.seed is not None and o.seed >= 0 else None, "stop": [s for s in stop if s],
        "top_k": DEFAULT_TOP_K if o.top_k is None else max(o.top_k, 0),
    }
    for src, dst in (("min_p", "min_p"), ("repeat_penalty", "repetition_penalty"),
                     ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty")):
        if getattr(o, src) is not None:
            values[dst] = getattr(o, src)
    return Sampling(**{k: v for k, v in values.items() if k in _SAMPLING_FIELDS})


def _budget(o: Options, prompt_len: int, route: ModelRoute) -> int:
    """num_ctx is clamped to the model's max_model_len; num_predict <= 0 (Ollama's default) fills the context."""
    ctx = min(o.num_ctx or route.max_model_len, route.max_model_len)
    room = ctx - prompt_len
    if room < 1:
        raise ContextLengthExceeded(
            f"the prompt is {prompt_len} tokens, which leaves no room in the context window of {ctx} tokens "
            "(num_ctx); shorten the prompt")
    if o.num_predict is None or o.num_predict <= 0:
        return room
    if o.num_predict > room:
        raise ContextLengthExceeded(
            f"the prompt ({prompt_len} tokens) plus num_predict ({o.num_predict}) exceeds the context window of "
            f"{ctx} tokens (num_ctx); lower num_predict or shorten the prompt")
    return o.num_predict


async def _encode(fn, *args) -> list[int]:
    # Tokenizing a long prompt takes milliseconds; keep it off the event loop (tokenizers releases the GIL).
    ids = await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    if not ids:
        raise InvalidRequest("the prompt is empty after templating")
    return ids


async def parse_generate(request: web.Request, st: GatewayState, vocab_sizes: dict[str, int]) -> Job:
    body = parse(GenerateBody, await read_body(request))
    route = find_route(st, body.model)
    _refuse_unsupported(body, body.model, bool(body.images))
    if body.suffix:
        raise InvalidRequest(f'"{body.model}" does not support insert')
    if body.template:
        raise InvalidRequest("template overrides are not supported: the model's own chat template is used")
    job = Job("generate", body.model, route, body.stream is not False, context=not body.raw)
    if not body.prompt and not body.system:
        job.load_reason = "unload" if _is_unload(body.keep_alive) else "load"
        return job
    tok = st.tokenizers[route.id]
    if body.raw:
        job.prompt = await _encode(tok.encode, body.prompt or "")
        job.upstream = UpstreamInput.text(body.prompt or "")
    else:
        msgs = [{"role": "system", "content": body.system}] if body.system else []
        msgs.append({"role": "user", "content": body.prompt or ""})
        history = _check_context(body.context or [], vocab_sizes.get(route.id))
        job.output, kwargs, reasoning = _output(body, route, st)
        job.prompt = history + await _encode(tok.encode_chat, msgs, None, kwargs)
        if not history:  # `context` is our token ids, which an upstream model cannot read
            job.upstream = UpstreamInput.chat(msgs, reasoning)
    job.sampling = dataclasses.replace(build_sampling(body.options, len(job.prompt), route),
                                       grammar=_grammar(body.format))
    return job


def _check_context(ids: list[int], vocab: int | None) -> list[int]:
    """`context` from an earlier answer is token ids; out-of-vocabulary ids never reach a node."""
    bad = [i for i in ids if i < 0 or (vocab and i >= vocab)]
    if bad:
        raise InvalidRequest(f"invalid context: token id {bad[0]} is outside the vocabulary (size {vocab})")
    return list(ids)


async def parse_chat(request: web.Request, st: GatewayState) -> Job:
    body = parse(ChatBody, await read_body(request))
    route = find_route(st, body.model)
    _refuse_unsupported(body, body.model, any(m.images for m in body.messages or []))
    tok = st.tokenizers[route.id]
    if body.tools and not tok.supports_tools:
        raise InvalidRequest(f'"{body.model}" does not support tools')
    job = Job("chat", body.model, route, body.stream is not False)
    if not body.messages:
        job.load_reason = "unload" if _is_unload(body.keep_alive) else "load"
        return job
    msgs = [_message(m) for m in body.messages]
    job.output, kwargs, reasoning = _output(body, route, st, body.tools)
    job.prompt = await _encode(tok.encode_chat, template_messages(msgs), body.tools or None, kwargs)
    job.upstream = UpstreamInput.chat([_upstream_message(m) for m in msgs], reasoning)
    job.sampling = dataclasses.replace(build_sampling(body.options, len(job.prompt), route),
                                       grammar=_grammar(body.format))
    return job


_HISTORY_FIELDS = ("thinking", "tool_calls", "tool_name")  # Ollama's message fields a template reads


def _message(m: ChatMessage) -> dict:
    """A chat message as Ollama takes it: an assistant's thinking and tool_calls (their arguments are objects) and
    a tool result's tool_name go along; gateway.text.history maps them to what templates read."""
    extra = m.model_extra or {}
    return {"role": m.role, "content": m.content or "",
            **{k: extra[k] for k in _HISTORY_FIELDS if extra.get(k) is not None}}


def _upstream_message(m: dict) -> dict:
    """An upstream takes OpenAI's message shape: Ollama's thinking and tool_name are ours to render, not its."""
    return {k: v for k, v in m.items() if k not in ("thinking", "tool_name")}


def chunk(job: Job, text: str, last: bool = False) -> dict:
    """One answer object; with a reasoning parser the text is split into `thinking` and the answer (`last`: the
    parser's held-back tail goes out too)."""
    thinking, calls = "", []
    if job.output is not None:
        d = job.output.feed(text)
        if last:
            rest = job.output.finish()
            d = type(d)(d.reasoning + rest.reasoning, d.content + rest.content, d.calls + rest.calls)
        text, thinking, calls = d.content, d.reasoning, _calls(job.output, d.calls)
    extra = {**({"thinking": thinking} if thinking else {}), **({"tool_calls": calls} if calls else {})}
    out: dict[str, Any] = {"model": job.name, "created_at": now_rfc3339()}
    if job.kind == "chat":
        out["message"] = {"role": "assistant", "content": text, **extra}
    else:
        out["response"] = text
        if thinking:
            out["thinking"] = thinking
    out["done"] = False
    return out


def _calls(output: OutputParser, calls: list) -> list[dict]:
    """Ollama's tool calls: each with its id and, in `function`, its index among the answer's calls (clients
    match parallel calls' results by them)."""
    first = output.calls - len(calls)  # the parser has counted these already
    out = []
    for i, c in enumerate(calls):
        call = c.ollama()
        out.append({"id": c.id, **call, "function": {"index": first + i, **call["function"]}})
    return out


def final(job: Job, text: str, done: Done, clock: Clock, generated: list[int]) -> dict:
    out = chunk(job, text, last=True)
    out.update(done=True, done_reason=done.finish_reason)
    if job.context:
        out["context"] = [*(job.prompt or []), *generated]
    d = clock.durations()
    out.update(total_duration=d["total_duration"], load_duration=d["load_duration"],
               prompt_eval_count=done.prompt_tokens, prompt_eval_duration=d["prompt_eval_duration"],
               eval_count=done.completion_tokens, eval_duration=d["eval_duration"])
    return out
