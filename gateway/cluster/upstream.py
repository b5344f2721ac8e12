"""The last fallback before 503: a model server outside the cluster (OpenAI-compatible, Ollama, any litellm
provider), called through litellm when no decode node of the pool can serve. `UpstreamGeneration` has the interface
of `generation.Generation`, so the OpenAI and Ollama handlers relay it unchanged, with path "upstream".

An upstream may run a different model with a different tokenizer, so it gets the request as the client wrote it
(chat messages or a text prompt), never our token ids: handlers put it in the request's `Prompt`; a prompt without
one (token-id prompts, tools, Ollama `context`) cannot go upstream.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, AsyncIterator

from kv_bridge.config.models import ModelRoute, UpstreamConfig
from kv_bridge.config.source import ConfigError
from kv_bridge.protocol import DoneLine, Path, Sampling, TokenLine

from gateway.errors import UpstreamError
from gateway.cluster.nodes import Lease

log = logging.getLogger("gateway.cluster.upstream")

UPSTREAM = Path.UPSTREAM  # the path, and what x-disagg-decode-node says


@dataclass(frozen=True)
class UpstreamInput:
    """The request in a form another model can take: chat messages, or a raw text prompt. `reasoning`: the
    reasoning parser the gateway runs on the answer (gateway.text.reasoning), so the upstream's reasoning is written in
    the markup that parser reads."""

    messages: list[dict] | None = None
    prompt: str | None = None
    reasoning: str | None = None

    @classmethod
    def chat(cls, messages: list[dict], reasoning: str | None = None) -> "UpstreamInput":
        """Chat messages, None-valued fields dropped."""
        return cls(messages=[{k: v for k, v in m.items() if v is not None} for m in messages], reasoning=reasoning)

    @classmethod
    def text(cls, prompt: str, reasoning: str | None = None) -> "UpstreamInput":
        return cls(prompt=prompt, reasoning=reasoning)


# (open reasoning, reasoning -> answer, open answer without reasoning) per reasoning parser. An upstream returns
# reasoning apart from the answer (litellm's `reasoning_content`); the gateway's parsers read text, so it is
# written back in the model's own markup, and every path is split by the same parser.
_MARKUP = {
    "harmony": ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>",
                "<|channel|>final<|message|>"),
    "think": ("<think>", "</think>", ""),
}


class _Markup:
    """Joins an upstream's reasoning and answer pieces into the text the route's reasoning parser reads; without a
    parser reasoning is dropped (the model's answer has no place for it)."""

    def __init__(self, parser: str | None) -> None:
        self.tags = _MARKUP.get(parser or "")
        self.state = ""  # "" | "reasoning" | "content"

    def __call__(self, reasoning: str, content: str) -> str:
        out = ""
        if reasoning and self.tags and self.state != "content":  # reasoning after the answer began is dropped
            out += self.tags[0] if self.state == "" else ""
            out += reasoning
            self.state = "reasoning"
        if content:
            if self.tags and self.state != "content":
                out += self.tags[1] if self.state == "reasoning" else self.tags[2]
            out += content
            self.state = "content"
        return out


@dataclass(frozen=True)
class Prompt:
    """One request's prompt: the token ids the cluster runs, and the input an upstream would get instead (None: the
    request cannot go upstream)."""

    ids: list[int]
    upstream: UpstreamInput | None = None


def check_upstreams(routes: list[ModelRoute]) -> None:
    """At start-up: litellm is installed and every named API key variable is set, or a ConfigError says the fix."""
    configured = [r for r in routes if r.upstream is not None]
    if configured and importlib.util.find_spec("litellm") is None:
        raise ConfigError(f"model {configured[0].id!r} has an upstream, which needs litellm: "
                          "pip install -e '.[gateway]' (or remove the model's upstream)")
    for r in configured:
        env = r.upstream.api_key_env
        if env and not os.environ.get(env):
            raise ConfigError(f"model {r.id!r}: upstream.api_key_env names {env}, which is not set; export it on the "
                              "gateway host or remove api_key_env")


_litellm: Any = None


async def _load_litellm() -> Any:
    """Import litellm once, off the event loop (it takes seconds), with its price table read from the package
    instead of the network. Two first calls at once both wait on Python's import lock; that is fine."""
    global _litellm
    if _litellm is None:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        mod = await asyncio.to_thread(importlib.import_module, "litellm")
        mod.suppress_debug_info = True
        mod.telemetry = False
        _litellm = mod
    return _litellm


def _register(litellm: Any, model: str) -> None:
    """Put the model in litellm's price table (at 0). Its cost accounting otherwise asks an Ollama server for the
    model's details with a blocking HTTP call on our event loop (`/api/show`), for every request."""
    if model not in litellm.model_cost:
        provider = model.split("/", 1)[0]
        litellm.register_model({model: {"litellm_provider": provider, "mode": "chat", "input_cost_per_token": 0.0,
                                        "output_cost_per_token": 0.0}})


def _request_kwargs(cfg: UpstreamConfig, sampling: Sampling) -> dict:
    """litellm arguments: the OpenAI sampling fields only. top_k, min_p and repetition_penalty have no OpenAI field,
    and logit_bias names token ids of our vocabulary, which another model does not share."""
    key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    if key is None and cfg.model.startswith("openai/"):
        key = "unused"  # the OpenAI SDK insists on a key; servers such as vLLM or llama.cpp ignore it
    kw: dict[str, Any] = {
        "model": cfg.model, "api_base": cfg.api_base, "api_key": key, "timeout": cfg.timeout_s, "stream": True,
        "drop_params": True, "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    if sampling.seed is not None:
        kw["seed"] = sampling.seed
    if sampling.stop:
        kw["stop"] = list(sampling.stop)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(sampling, name):
            kw[name] = getattr(sampling, name)
    if sampling.grammar is not None:  # the upstream constrains its own output (litellm maps it per provider)
        kw["response_format"] = _response_format(sampling.grammar)
    return kw


def _response_format(grammar: dict) -> dict:
    """The protocol's grammar as OpenAI's response_format."""
    if grammar.get("type") != "json_schema":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": grammar["schema"],
                                                   "strict": bool(grammar.get("strict"))}}


class _Upstream:
    """Stands where a Generation has its decode NodeState (headers and logs read `.name`)."""

    name = str(UPSTREAM)


class UpstreamGeneration:
    """One generation served by the upstream. Iterate `tokens()`; then `done` is set. Always `close()`.
    Tokens carry token_id -1: the upstream's tokens are not ours."""

    planned_path = path = UPSTREAM
    kv_requested = False
    prefill = None
    prefill_s = None
    prefill_ms = 0.0

    def __init__(self, lease: Lease, route: ModelRoute, prompt: list[int], inp: UpstreamInput,
                 fallbacks: list[str]) -> None:
        assert route.upstream is not None
        self._lease, self.route, self.prompt, self.input = lease, route, prompt, inp
        self.fallbacks = fallbacks
        self.decode = _Upstream()
        self.request_id = f"upstream-{id(self):x}"
        self.done: DoneLine | None = None
        self._stream: Any = None
        self._closed = False

    async def open(self, sampling: Sampling) -> None:
        """Start the upstream stream; raises UpstreamError when the upstream cannot be reached or refuses."""
        cfg = self.route.upstream
        litellm = await _load_litellm()
        _register(litellm, cfg.model)
        kw = _request_kwargs(cfg, sampling)
        try:
            if self.input.messages is not None:
                self._stream = await litellm.acompletion(messages=self.input.messages,
                                                         stream_options={"include_usage": True}, **kw)
            else:
                self._stream = await litellm.atext_completion(prompt=self.input.prompt, **kw)
        except Exception as e:  # litellm maps every provider's failure to its own exception tree
            raise UpstreamError(f"upstream {cfg.model} failed: {type(e).__name__}: {e}") from None

    async def tokens(self) -> AsyncIterator[TokenLine]:
        finish, usage, n = None, None, 0
        markup = _Markup(self.input.reasoning)
        try:
            async for chunk in self._stream:
                usage = getattr(chunk, "usage", None) or usage
                for choice in getattr(chunk, "choices", None) or []:
                    text = markup(*_choice_text(choice))
                    finish = getattr(choice, "finish_reason", None) or finish
                    if text:
                        n += 1
                        yield TokenLine(-1, text)
        except Exception as e:
            raise UpstreamError(f"upstream {self.route.upstream.model} stream broke: {type(e).__name__}: {e}") from None
        prompt_tokens = getattr(usage, "prompt_tokens", 0) or len(self.prompt)
        completion_tokens = getattr(usage, "completion_tokens", 0) or n
        self.done = DoneLine(finish_reason="length" if finish == "length" else "stop", prompt_tokens=prompt_tokens,
                         completion_tokens=completion_tokens, kv_tokens=0, fallback_reason=None, kv_transfer_s=0.0,
                         kv_bytes=0)

    def headers(self) -> dict[str, str]:
        out = {"x-disagg-path": str(UPSTREAM), "x-disagg-kv-tokens": "0", "x-disagg-prefix-tokens": "0",
               "x-disagg-prefill-ms": "0", "x-disagg-decode-node": str(UPSTREAM)}
        if self.fallbacks:
            out["x-disagg-fallbacks"] = ",".join(self.fallbacks)
        return out

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lease.release(finished=False)
        stream, self._stream = self._stream, None
        if stream is not None and self.done is None:
            await _close_stream(stream)


def _choice_text(choice: Any) -> tuple[str, str]:
    """(reasoning, answer text) of one chunk's choice; litellm puts every provider's reasoning (vLLM's `reasoning`,
    Ollama's `thinking`) in `reasoning_content`."""
    delta = getattr(choice, "delta", None)
    if delta is not None:  # chat chunk
        return getattr(delta, "reasoning_content", None) or "", getattr(delta, "content", None) or ""
    return "", getattr(choice, "text", None) or ""  # text-completion chunk


async def _close_stream(stream: Any) -> None:
    """Drop an unfinished upstream stream so the upstream stops generating (litellm wrappers differ in how)."""
    for name in ("aclose", "close"):
        fn = getattr(stream, name, None) or getattr(getattr(stream, "completion_stream", None), name, None)
        if fn is None:
            continue
        try:
            result = fn()
            if asyncio.iscoroutine(result):
                await result
            return
        except Exception as e:  # closing is best effort; the connection times out otherwise
            log.debug("closing the upstream stream failed: %s", e)
            return
