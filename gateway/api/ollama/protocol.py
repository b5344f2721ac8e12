"""Ollama's request models for /api/generate and /api/chat (their translation into the shared request is
translate.py), and its answer shapes (NDJSON chunks, the final object with timings in nanoseconds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import Field

from kv_bridge.config import ModelRoute
from kv_bridge.protocol import DoneLine as Done
from kv_bridge.protocol import Sampling

from gateway.api.protocol import APIModel, MinP, Penalty, RepetitionPenalty, Temperature
from gateway.api.serving import GatewayState
from gateway.errors import ModelNotFound
from gateway.text.output import OutputParser
from gateway.cluster.upstream import UpstreamInput


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
