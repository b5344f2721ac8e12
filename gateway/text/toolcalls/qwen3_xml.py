"""qwen3-coder's XML-style calls: `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`.

Values are text; the request's tool schema gives their JSON types (integer, number, boolean, object, array).
"""

from __future__ import annotations

import json
import re

from gateway.text.toolcalls.base import ToolCall, ToolParser

_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


class Qwen3XMLToolParser(ToolParser):
    def parse_call(self, body: str) -> list[ToolCall] | None:
        calls = []
        for name, inner in _FUNCTION.findall(body):
            if _PARAMETER.sub("", inner).strip():  # an unclosed or stray parameter: not a call we can trust
                return None
            props = self.tools.get(name, {}).get("parameters", {}).get("properties", {})
            args = {p: _typed(_strip_newline(v), props.get(p, {})) for p, v in _PARAMETER.findall(inner)}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        leftover = _PARAMETER.sub("", _FUNCTION.sub("", body)).strip()
        return calls if calls and not leftover else None


def _strip_newline(v: str) -> str:
    """The template writes values on their own lines: drop one newline each side, keep the rest."""
    v = v[1:] if v.startswith("\n") else v
    return v[:-1] if v.endswith("\n") else v


def _typed(value: str, schema: dict):
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if value.strip() == "null" and "null" in kinds:
        return None
    try:
        if "integer" in kinds:
            return int(value.strip())
        if "number" in kinds:
            f = float(value.strip())
            return int(f) if f.is_integer() and "." not in value else f
        if "boolean" in kinds:
            if value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
        if "object" in kinds or "array" in kinds:
            return json.loads(value)
    except ValueError:  # the model wrote a value its schema does not allow: keep its text, as vLLM does
        return value
    return value
