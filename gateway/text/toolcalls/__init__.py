"""Tool-call parsers: one file per model output format, registered in PARSERS by name.

Each parser is fed streamed text and returns plain text and finished calls; a malformed call comes back as text.
"""

from __future__ import annotations

from gateway.text.toolcalls.base import ToolCall, ToolDelta, ToolParser
from gateway.text.toolcalls.harmony import HarmonyToolParser
from gateway.text.toolcalls.hermes import HermesToolParser
from gateway.text.toolcalls.qwen3_xml import Qwen3XMLToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,  # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5, Qwen3)
    "qwen3_coder": Qwen3XMLToolParser,  # <tool_call><function=NAME><parameter=P>v</parameter></function></tool_call>
    "harmony": HarmonyToolParser,  # gpt-oss: commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
}


def tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """A fresh parser for format `name` (tools: the request's OpenAI tool list, for parameter types)."""
    try:
        cls = PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
    return cls(tools or [])


__all__ = ["PARSERS", "ToolCall", "ToolDelta", "ToolParser", "tool_parser"]
