"""Anthropic requests into the shared chat request: `system` and content blocks become chat messages (tool_use as
assistant `tool_calls`, tool_result as `tool` messages, Anthropic's mid-conversation system messages in place or
joined to the first), tools and tool_choice their chat forms, `stop_sequences` the stop strings."""

from __future__ import annotations

import json
from typing import Any

from gateway.api import translate
from gateway.api.anthropic.protocol import CountTokensRequest, InputMessage, MessagesRequest
from gateway.api.openai.protocol import ChatRequest
from gateway.api.translate import function_tool, named_function, text_of
from gateway.errors import InvalidRequest

# Claude Code's attribution line opens its system prompt with a per-request hash: dropped (as vLLM does), or no
# two requests would share a cached prefix.
_BILLING = "x-anthropic-billing-header"


def _system_text(content: Any, where: str) -> str:
    """A system prompt's text, without Claude Code's billing line."""
    if isinstance(content, str):
        return "" if content.startswith(_BILLING) else content
    blocks = [b for b in content or [] if not (isinstance(b, dict) and str(b.get("text", "")).startswith(_BILLING))]
    return text_of(blocks, where)


def _user(msg: InputMessage, where: str) -> list[dict]:
    """A user turn: its tool_result blocks as tool messages, its text as one user message after them."""
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    out, text = [], []
    for i, b in enumerate(msg.content):
        kind = b.get("type")
        if kind == "tool_result":
            body = text_of(b.get("content"), f"{where}.content[{i}].content")
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                        "content": f"Error: {body}" if b.get("is_error") else body})
        elif kind == "text":
            text.append(str(b.get("text", "")))
        else:
            raise InvalidRequest(f"{where}.content[{i}]: {kind!r} blocks are not supported (text and tool_result "
                                 f"are)", param=f"{where}.content")
    return out + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant(msg: InputMessage, where: str) -> dict:
    """An assistant turn: text as content, tool_use blocks as tool_calls, thinking blocks as its reasoning (the chat
    APIs' passback: gpt-oss's template renders a tool-call turn's; redacted thinking has no text to give back)."""
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    text, calls, thinking = [], [], []
    for i, b in enumerate(msg.content):
        kind = b.get("type")
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(b.get("thinking") or ""))
        elif kind == "tool_use":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}})
        elif kind != "redacted_thinking":
            raise InvalidRequest(f"{where}.content[{i}]: {kind!r} blocks are not supported in assistant turns",
                                 param=f"{where}.content")
    out: dict = {"role": "assistant", "content": "".join(text) or None}
    if "".join(thinking):
        out["reasoning"] = "".join(thinking)
    return {**out, "tool_calls": calls} if calls else out


def chat_messages(req: CountTokensRequest, inline_system: bool = True) -> list[dict]:
    """The chat messages; `system`-role messages stay where they are, or, where the template renders no system
    message after the first (`inline_system` False), join the leading system prompt."""
    system = [_system_text(req.system, "system")] if req.system else []
    out: list[dict] = []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role == "system":
            text = _system_text(m.content, f"{where}.content")
            if text and inline_system:
                out.append({"role": "system", "content": text})
            elif text:
                system.append(text)
        else:
            out += _user(m, where) if m.role == "user" else [_assistant(m, where)]
    system = [t for t in system if t]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Client tools as chat function tools; Anthropic's server tools (web search, code execution...) are refused."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            raise InvalidRequest(f"tools[{i}]: only custom tools with a name and input_schema are supported, not "
                                 f"{t.get('type')!r}", param=f"tools[{i}]")
        out.append(function_tool(t["name"], parameters=t.get("input_schema") or {"type": "object", "properties": {}},
                                  description=t.get("description") or None))
    return out


def chat_tool_choice(choice: dict | None) -> str | dict | None:
    kind = (choice or {}).get("type")
    if choice is None:
        return None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return named_function(choice.get("name"))
    raise InvalidRequest(f"tool_choice.type must be auto, any, tool or none, not {kind!r}", param="tool_choice.type")


def chat_request(req: CountTokensRequest, inline_system: bool = True) -> ChatRequest:
    body = {"model": req.model, "messages": chat_messages(req, inline_system), "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice)}
    out = req.output_config
    if out is not None:
        body["reasoning_effort"] = out.reasoning_effort()
        if out.format is not None:  # structured output: the decode node masks by the schema's grammar
            body["response_format"] = {"type": "json_schema", "json_schema": {"schema": out.format.schema_,
                                                                              "strict": True}}
    if not isinstance(req, MessagesRequest):
        return translate.chat_request(body, None)
    body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k)
    return translate.chat_request(body, req.model_extra)  # `stop` is stop_sequences, never an extra
