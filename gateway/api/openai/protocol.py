"""OpenAI request validation (pydantic) for /v1/chat/completions and /v1/completions.

Shape and range errors come from pydantic; `check()` adds the cross-field rules. Both become a 400 whose
`param` names the field. Response shapes live in gateway.api.openai.framing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator

from kv_bridge.protocol import json_grammar

from gateway.api.protocol import (MAX_LOGIT_BIAS, MAX_N, MAX_STOP, MAX_TOP_LOGPROBS, APIModel, MinP, Penalty,
                                  RepetitionPenalty, Temperature, TopK, TopP, parse)
from gateway.errors import InvalidRequest
from gateway.text.history import template_messages
from gateway.text.toolcalls.forced import allowed_tools

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy completions API's own default (vLLM's too)
OpenAITemperature = Annotated[Temperature, Field(le=2.0)]  # OpenAI's documented range (Responses' too)


class TextPart(APIModel):
    type: Literal["text"]
    text: str


class Message(APIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class StreamOptions(APIModel):
    include_usage: bool = False


class JsonSchemaFormat(APIModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = False


class ResponseFormat(APIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> dict | None:
        """The protocol's grammar (the decode node compiles it and masks what would break it)."""
        if self.type == "json_object":
            return json_grammar()
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidRequest("response_format json_schema needs a json_schema object with a schema",
                                     param="response_format.json_schema")
            return json_grammar(self.json_schema.schema_, bool(self.json_schema.strict))
        return None


class GenerationRequest(APIModel):
    """Fields both endpoints share. Unknown OpenAI fields (user, metadata, ...) are accepted and ignored."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: OpenAITemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, Any] | None) -> dict[str, float] | None:
        if v is None:
            return None
        out = {}
        for key, bias in v.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids written as decimal strings, got {key!r}")
            number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
            if not number or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails the comparison too
                raise ValueError(f"bias for token {key} must be a number in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                                 f"got {bias!r}")
            out[str(int(key))] = float(bias)
        return out

    def check(self, vocab_size: int) -> None:
        """Rules that span fields or need the model; raises InvalidRequest naming the param."""
        self.grammar()
        bad = [k for k in (self.logit_bias or {}) if int(k) >= vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias: token id {bad[0]} is outside the vocabulary (size {vocab_size})",
                                 param="logit_bias")

    def grammar(self) -> dict | None:
        """response_format as the protocol's grammar (None: free text)."""
        return None if self.response_format is None else self.response_format.grammar()

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def choices(self) -> int:
        return self.n or 1


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: extra variables for the chat template
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def check(self, vocab_size: int, supports_tools: bool = False) -> None:
        super().check(vocab_size)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
        if self.tools and not supports_tools:
            raise InvalidRequest("this model's chat template does not support tools; send the request without them",
                                 param="tools")
        if self.forced_tools() and self.grammar() is not None:
            raise InvalidRequest("a forced tool call (tool_choice 'required' or a named function) cannot be combined "
                                 "with a response_format", param="tool_choice")

    def forced_tools(self) -> list[dict] | None:
        """The tools a call must go to when `tool_choice` forces one ("required" or a named function), else None."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        if not self.tools:
            raise InvalidRequest(f"tool_choice {choice!r} requires tools", param="tool_choice")
        try:
            return allowed_tools(self.tools, choice)
        except ValueError as e:
            raise InvalidRequest(str(e), param="tool_choice") from None

    def top_alternatives(self) -> int | None:
        """Alternatives per token the decode node reports; None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def messages_as_dicts(self) -> list[dict]:
        """The messages for the chat template (gateway.text.history: reasoning under every name templates read, tool
        call arguments as objects)."""
        return template_messages([m.model_dump(exclude_none=False) for m in self.messages])

    def client_messages(self) -> list[dict]:
        """The messages as the client sent them, for an upstream server (which takes OpenAI's own shape: Ollama's
        thinking and tool_name are ours to render, not its)."""
        return [m.model_dump(exclude_none=True, exclude={"thinking", "tool_name"}) for m in self.messages]

    def effort(self) -> tuple[str | None, bool | None]:
        """(reasoning effort, thinking switch) for gateway.text.reasoning.template_kwargs. vLLM's "none" switches
        thinking off (harmony cannot: low); "minimal" is the least effort a template knows, low."""
        if self.reasoning_effort == "none":
            return None, False
        return ("low" if self.reasoning_effort == "minimal" else self.reasoning_effort), None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    def check(self, vocab_size: int) -> None:
        super().check(vocab_size)
        if self.echo:
            raise InvalidRequest("echo is not supported by this server", param="echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.choices():
            raise InvalidRequest("best_of must equal n: this server returns every generation", param="best_of")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequest("one prompt per request: send a string, a list of token ids, or a list of one",
                                     param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if isinstance(prompt, list) and not all(0 <= t < vocab_size for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", param="prompt")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        return p[0] if isinstance(p, list) and p and isinstance(p[0], (str, list)) else p


def parse_chat_request(body: Any) -> ChatRequest:
    return parse(ChatRequest, body)


def parse_completion_request(body: Any) -> CompletionRequest:
    return parse(CompletionRequest, body)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
