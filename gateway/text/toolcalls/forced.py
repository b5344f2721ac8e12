"""Forced tool calls (`tool_choice` "required" or a named function): a grammar in llguidance's Lark dialect that
admits only a call in the model's own format, to one of the allowed tools, with arguments valid for its schema.
The gateway builds it (it knows the tool parser and the tokenizer); the decode node masks by it like any grammar.

Formats, as the parsers in this package read them back:
- harmony (gpt-oss): optional analysis, then `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
  + JSON arguments + `<|call|>`;
- qwen3_coder: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`,
  parameters in schema order, required ones always; a value that may be a string (nullable, untyped) as raw text
  (the parser reads `null` back as null), a string enum as one of its values, the rest as JSON;
- hermes: `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`.
A marker that is one token of the tokenizer is written as a token (`<tool_call>`), else as text.
"""

from __future__ import annotations

import json
from typing import Callable

from gateway.text.toolcalls.schema_types import schema_types

FORCED_PARSERS = ("harmony", "qwen3_coder", "hermes")
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def allowed_tools(tools: list[dict], choice) -> list[dict]:
    """The tools a `tool_choice` of "required" or {"type": "function", "function": {"name": N}} allows; ValueError
    (the gateway's 400) for a name that is not among `tools`."""
    if choice == "required":
        return tools
    name = ((choice or {}).get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    chosen = [t for t in tools if _name(t) == name]
    if not chosen:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                         f"({', '.join(repr(_name(t)) for t in tools)})")
    return chosen


def forced_call_grammar(parser: str, tools: list[dict], is_token: Callable[[str], bool]) -> dict:
    """The wire grammar ({"type": "lark", "grammar": text}) for one call to one of `tools` in `parser`'s format.
    `is_token(text)`: whether the tokenizer has `text` as a single (added) token."""
    if parser not in FORCED_PARSERS:
        raise ValueError(f"a tool call cannot be forced in this model's tool-call format ({parser or 'unknown'}; "
                         f"forced calls: {', '.join(FORCED_PARSERS)}); use tool_choice 'auto'")
    build = {"harmony": _harmony, "qwen3_coder": _qwen3_coder, "hermes": _hermes}[parser]
    return {"type": "lark", "grammar": build(tools, _Marker(is_token))}


class _Marker:
    def __init__(self, is_token: Callable[[str], bool]) -> None:
        self.is_token = is_token

    def __call__(self, text: str) -> str:
        return text if self.is_token(text) else _lit(text)


def _harmony(tools: list[dict], tok: _Marker) -> str:
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    lines = [
        f"start: analysis? ({calls})",
        f'analysis: {tok("<|channel|>")} "analysis" {tok("<|message|>")} analysis_text {tok("<|end|>")} '
        f'{tok("<|start|>")} "assistant"',
        "analysis_text: /(?s:[^<]|<[^|])*/",
    ]
    for i, t in enumerate(tools):
        lines.append(f'call_{i}: {tok("<|channel|>")} {_lit(f"commentary to=functions.{_name(t)} ")}'
                     f'{tok("<|constrain|>")} "json" {tok("<|message|>")} %json {_schema(_parameters(t))} '
                     f'{tok("<|call|>")}')
    return "\n".join(lines) + "\n"


def _qwen3_coder(tools: list[dict], tok: _Marker) -> str:
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    end_fn, end_param = _lit("</function>\n"), _lit("\n</parameter>\n")
    lines = [f'start: {tok("<tool_call>")} "\\n" ({calls}) {end_fn} {tok("</tool_call>")}']
    for i, t in enumerate(tools):
        schema = _parameters(t)
        required = set(schema.get("required") or [])
        parts = []
        for j, (p, ps) in enumerate((schema.get("properties") or {}).items()):
            rule, ps = f"p_{i}_{j}", ps if isinstance(ps, dict) else {}
            parts.append(rule if p in required else f"{rule}?")
            lines += _qwen3_value(rule, f"v_{i}_{j}", _lit(f"<parameter={p}>\n"), ps, end_param)
        lines.append(f"call_{i}: {_lit(f'<function={_name(t)}>' + chr(10))} {' '.join(parts)}".rstrip())
    return "\n".join(lines) + "\n"


def _qwen3_value(rule: str, value: str, head: str, schema: dict, end: str) -> list[str]:
    """Rules for one parameter's value as the template writes it and the parser reads it back (schema_types)."""
    types = schema_types(schema)
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if types == {"string"} and isinstance(choices, list) and choices:  # an enum, typed or not: one of its texts
        return [f"{rule}: {head} ({' | '.join(_lit(c) for c in choices)}) {end}"]
    if "string" in types:  # raw text up to the closing tag, as the template writes strings
        return [f"{rule}: {head} {value}", f"{value}[stop={end}]: /(?s:.*)/"]
    return [f"{rule}: {head} %json {_schema(schema)} {end}"]


def _hermes(tools: list[dict], tok: _Marker) -> str:
    one_of = [{"type": "object", "properties": {"name": {"const": _name(t)}, "arguments": _parameters(t)},
               "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = one_of[0] if len(one_of) == 1 else {"anyOf": one_of}
    return f'start: {tok("<tool_call>")} "\\n" %json {_schema(schema)} "\\n" {tok("</tool_call>")}\n'


def _name(tool: dict) -> str:
    return str(((tool or {}).get("function") or {}).get("name", ""))


def _parameters(tool: dict) -> dict:
    params = ((tool or {}).get("function") or {}).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def _schema(schema: dict) -> str:
    """A schema for %json, compact (a small model otherwise pads with whitespace until max_tokens runs out)."""
    return json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)
