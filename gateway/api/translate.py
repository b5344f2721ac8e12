"""What every API's translation into the shared `ChatRequest` uses: content parts as text, function tools and a
named tool choice in the chat form, and the request itself, parsed with the chat request's own checks."""

from __future__ import annotations

from typing import Any

from gateway.api.chat_job import EXTRA_SAMPLING
from gateway.api.openai.protocol import ChatRequest, parse_chat_request
from gateway.errors import InvalidRequest


def text_of(content: Any, param: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A message's content (a string, or parts of the `kinds` given) as one string; other parts are refused."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise InvalidRequest(f"{param} must be a string or a list of text parts", param=param)
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise InvalidRequest(f"{param}[{i}]: only text parts are supported here, not {kind!r}", param=param)
        out.append(str(part.get("text", "")))
    return "".join(out)


def function_tool(name: Any, **fields: Any) -> dict:
    """A chat function tool: its name, then `fields` (description, parameters, strict) in the caller's order, which
    the template renders as given; fields left None are left out."""
    return {"type": "function", "function": {"name": name, **{k: v for k, v in fields.items() if v is not None}}}


def named_function(name: Any) -> dict:
    """The chat tool_choice that forces a call to the function `name`."""
    return {"type": "function", "function": {"name": name}}


def chat_request(body: dict, extra: dict | None) -> ChatRequest:
    """The shared request from a translated `body`; sampling fields beyond the API's own come from its extra body
    (`extra`), as vLLM's servers take them. Fields left None are left out."""
    body = {**{k: v for k, v in (extra or {}).items() if k in EXTRA_SAMPLING}, **body}
    return parse_chat_request({k: v for k, v in body.items() if v is not None})
