"""Chat history as chat templates read it, from OpenAI and Ollama messages alike: an assistant turn's reasoning
under every name published templates use, tool results named after their call, call arguments as objects.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import InvalidRequest

# Where clients put an assistant turn's reasoning: OpenAI-compatible servers (vLLM, litellm) send
# `reasoning_content` or `reasoning`, Ollama sends `thinking`. Templates read one of them: gpt-oss's published
# template reads `thinking` (harmony needs a tool-call turn's analysis back), Qwen3's reads `reasoning_content`,
# vLLM passes `reasoning`. So the first one present goes under all three names.
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def template_messages(messages: list[dict], param: str = "messages") -> list[dict]:
    """A copy of `messages` ready for the chat template; malformed history is an InvalidRequest naming `param`."""
    names: dict[str, str] = {}  # tool call id -> function name, for tool results that name only the id
    last_call = ""
    out = []
    for i, msg in enumerate(messages):
        msg = dict(msg)
        role = msg.get("role")
        if role == "assistant":
            msg = _assistant(msg, f"{param}[{i}]")
            for call in msg.get("tool_calls") or []:
                last_call = call["function"]["name"]
                if call.get("id"):
                    names[str(call["id"])] = last_call
        elif role == "tool":
            msg = _tool(msg, names, last_call)
        out.append(msg)
    return out


def _assistant(msg: dict, where: str) -> dict:
    reasoning = next((msg[k] for k in REASONING_KEYS if msg.get(k)), None)
    for k in REASONING_KEYS:  # an empty or null field must not reach templates that test `"thinking" in message`
        msg.pop(k, None)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise InvalidRequest(f"{where}: reasoning must be a string", param=where)
        msg.update({k: reasoning for k in REASONING_KEYS})
    calls = msg.get("tool_calls")
    if calls is None:
        msg.pop("tool_calls", None)  # templates test `"tool_calls" in message`
    elif isinstance(calls, list):
        msg["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    else:
        raise InvalidRequest(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    return msg


def _call(call: Any, where: str) -> dict:
    """One history tool call with its arguments as an object (templates iterate them, as vLLM passes them); null,
    "" or blank arguments are a call without arguments."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequest(f"{where}: a tool call needs a function with a name", param=where)
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise InvalidRequest(f"{where}: arguments must be a JSON object text", param=where) from None
    if not isinstance(args, dict):
        raise InvalidRequest(f"{where}: arguments must be a JSON object", param=where)
    return {**call, "function": {**fn, "arguments": args}}


def _tool(msg: dict, names: dict[str, str], last_call: str) -> dict:
    """A tool result's function name: its own `name`, Ollama's `tool_name`, or the call its `tool_call_id` names
    (harmony writes the tool's name in the result's header)."""
    name = msg.get("name") or msg.pop("tool_name", None) or names.get(str(msg.get("tool_call_id"))) or last_call
    if name:
        msg["name"] = name
    return msg
