"""Ollama's request models for /api/generate and /api/chat, and `Job`, one validated request as the handlers run it
(translate.py makes it from the shared request path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from kv_bridge.config.models import ModelRoute
from kv_bridge.protocol import Sampling

from gateway.api.protocol import APIModel, MinP, Penalty, RepetitionPenalty, Temperature
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


class ShowBody(APIModel):
    model: str | None = None
    name: str | None = None  # the field's pre-0.1 spelling, still accepted


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
