"""gpt-oss harmony calls: a message to `functions.NAME` (`<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>`), found by gateway.text.reasoning's HarmonyParser, which also splits analysis from final."""

from __future__ import annotations

from gateway.text.reasoning import HarmonyMessage, HarmonyParser
from gateway.text.toolcalls.base import ToolCall, ToolDelta, arguments_text


def call_from_message(m: HarmonyMessage) -> ToolCall | None:
    """The call a tool-addressed message makes; None when it is not a well-formed function call."""
    if not m.recipient.startswith("functions.") or len(m.recipient) == len("functions."):
        return None
    try:
        args = arguments_text(m.body.strip() or "{}")
    except ValueError:
        return None
    return None if args is None else ToolCall(m.recipient[len("functions."):], args)


def message_text(m: HarmonyMessage) -> str:
    """A malformed call given back as the text the model wrote."""
    return f"<|channel|>{m.channel} to={m.recipient} <|constrain|>{m.content_type}<|message|>{m.body}<|call|>"


class HarmonyToolParser:
    """Tool calls from harmony output; final text is content (analysis is dropped here: use HarmonyParser itself
    to keep both reasoning and calls, with `calls_from`)."""

    def __init__(self, tools: list[dict]):
        self.parser = HarmonyParser()

    def feed(self, text: str) -> ToolDelta:
        return calls_from(self.parser.feed(text))

    def finish(self) -> ToolDelta:
        return calls_from(self.parser.finish())


def calls_from(delta) -> ToolDelta:
    out = ToolDelta(content=delta.content)
    for m in delta.messages:
        call = call_from_message(m)
        if call is None:
            out.content += message_text(m)
        else:
            out.calls.append(call)
    return out
