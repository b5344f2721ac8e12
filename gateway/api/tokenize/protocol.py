"""vLLM's tokenize and detokenize requests: a prompt, or chat messages as /v1/chat/completions takes them."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gateway.api.openai.protocol import Message
from gateway.api.protocol import APIModel


class _Body(APIModel):
    model: str | None = None  # vLLM serves one model; here it may be left out when the gateway serves one
    return_token_strs: bool | None = False


class TokenizeCompletion(_Body):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChat(_Body):
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes the special tokens
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class Detokenize(APIModel):
    model: str | None = None
    tokens: list[int]
