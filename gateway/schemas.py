"""OpenAI chat-completion request validation (pydantic) and the response/chunk shapes the gateway sends."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ContextLengthExceeded, InvalidRequest

DEFAULT_MAX_TOKENS = 256


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatRequest(BaseModel):
    # Unknown OpenAI fields (logprobs, user, ...) are accepted and ignored, as clients send many.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=1, description="only one choice is generated")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def messages_as_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_none=False) for m in self.messages]


_FIELD_NAMES = set(ChatRequest.model_fields) | set(Message.model_fields) | set(TextPart.model_fields)
_FIELD_NAMES |= set(StreamOptions.model_fields)


def _param(loc: tuple) -> str | None:
    """Pydantic loc -> OpenAI param: ('messages', 0, 'content', 'str') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES:
            out += f".{part}" if out else part
        else:  # a union member tag such as 'str' or 'list[TextPart]': the field above it is the param
            break
    return out or None


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(tuple(err["loc"]))
        raise InvalidRequest(f"{param or 'body'}: {err['msg']}", param=param) from None


def resolve_max_tokens(req: ChatRequest, prompt_tokens: int, max_model_len: int) -> int:
    """The generation budget; a request that cannot fit the model's context is refused before any work."""
    requested = req.max_completion_tokens or req.max_tokens
    if requested is None:
        # Without an explicit budget, shrink the default to what fits rather than refuse.
        room = max_model_len - prompt_tokens
        if room >= 1:
            return min(DEFAULT_MAX_TOKENS, room)
        requested = DEFAULT_MAX_TOKENS
    if prompt_tokens + requested > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the messages, {requested} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="messages",
        )
    return requested


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(cid: str, created: int, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": use,
    }


class ChunkBuilder:
    """chat.completion.chunk objects for one stream; with include_usage every chunk carries `usage: null`."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool) -> None:
        self.cid, self.created, self.model, self.include_usage = cid, created, model, include_usage

    def _chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        out = {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = use
        return out

    def delta(self, delta: dict, finish_reason: str | None = None) -> dict:
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])

    def role(self) -> dict:
        return self.delta({"role": "assistant", "content": ""})

    def content(self, text: str) -> dict:
        return self.delta({"content": text})

    def finish(self, finish_reason: str) -> dict:
        return self.delta({}, finish_reason)

    def usage(self, use: dict) -> dict:
        return self._chunk([], use)
