"""JSON in `<tool_call>` (Hermes, Qwen2.5, Qwen3 templates):
`<tool_call>{"name": N, "arguments": {...}}</tool_call>`.
"""

from __future__ import annotations

import json

from gateway.text.toolcalls.base import ToolCall, ToolParser, arguments_text


class HermesToolParser(ToolParser):
    def parse_call(self, body: str) -> list[ToolCall] | None:
        obj = json.loads(body.strip())
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = arguments_text(obj.get("arguments", obj.get("parameters", {})))
        return None if args is None else [ToolCall(obj["name"], args)]
