"""Responses API requests (pydantic); their translation into the shared chat request is translate.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.api.protocol import APIModel, TopP, parse
from gateway.api.openai.protocol import OpenAITemperature

# Effort names the Responses API has beyond the chat templates' low/medium/high.
_EFFORT = {"minimal": "low", "none": "low"}


class Reasoning(APIModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class TextFormat(APIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(APIModel):
    format: TextFormat | None = None


class ResponsesRequest(APIModel):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: OpenAITemperature | None = None
    top_p: TopP | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None

    def effort(self) -> str | None:
        e = self.reasoning.effort if self.reasoning else None
        return _EFFORT.get(e or "", e)


def parse_responses_request(body: Any) -> ResponsesRequest:
    return parse(ResponsesRequest, body)
