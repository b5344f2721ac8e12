"""Anthropic Messages API requests (pydantic); their translation into the shared chat request is translate.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.api.protocol import APIModel, Temperature, TopK, TopP


class InputMessage(APIModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class Thinking(APIModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class OutputFormat(APIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(APIModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None

    def reasoning_effort(self) -> str | None:
        """As the chat templates take it: they know low, medium and high."""
        return {"xhigh": "high", "max": "high"}.get(self.effort or "", self.effort)


class CountTokensRequest(APIModel):
    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    def think(self) -> bool | None:
        """The template's thinking switch: off when disabled, on when enabled, else the template's default."""
        kind = self.thinking.type if self.thinking else None
        return {"enabled": True, "disabled": False}.get(kind or "")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: Annotated[Temperature, Field(le=1.0)] | None = None  # Anthropic's range
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: dict[str, Any] | None = None
