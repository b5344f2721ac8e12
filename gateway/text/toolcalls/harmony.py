"""gpt-oss harmony calls: a message to `functions.NAME` (`<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>`), found by gateway.text.reasoning's HarmonyParser, which also splits analysis from final.
As vLLM: the arguments are the message body as the model wrote it (invalid JSON too), and messages to built-in
tools (`python`, `browser.*`) are neither calls nor content."""

from __future__ import annotations

from gateway.text.reasoning import Delta, HarmonyParser
from gateway.text.toolcalls.base import CallPiece, ToolCall, ToolDelta


def function_name(recipient: str) -> str | None:
    """NAME of a `functions.NAME` recipient; None for any other recipient."""
    name = recipient[len("functions."):] if recipient.startswith("functions.") else ""
    return name or None


class HarmonyCalls:
    """Turns a HarmonyParser's tool-addressed messages into calls: pieces as the body streams (the name when the
    header ends), the whole call when the message ends."""

    def __init__(self) -> None:
        self.live: dict[int, ToolCall] = {}  # message number -> its call so far
        self.numbers: dict[int, int] = {}  # message number -> call number
        self.started = 0

    def split(self, d: Delta) -> ToolDelta:
        out = ToolDelta(content=d.content)
        for msg, recipient, text in d.pieces:
            name = function_name(recipient)
            if name is None:
                continue
            if msg not in self.live:
                call = self.live[msg] = ToolCall(name, "")
                self.numbers[msg] = self.started
                self.started += 1
                out.pieces.append(CallPiece(self.numbers[msg], "", name, call.id))
            if text:
                self.live[msg].arguments += text
                out.pieces.append(CallPiece(self.numbers[msg], text))
        for m in d.messages:
            call = self.live.pop(m.number, None)
            if call is None:
                continue
            if not call.arguments.strip():  # a call without arguments: the empty object
                out.pieces.append(CallPiece(self.numbers[m.number], "{}"))
                call.arguments += "{}"
            out.calls.append(call)
        return out


class HarmonyToolParser:
    """Tool calls from harmony output; final text is content (analysis is dropped here: OutputParser keeps both
    reasoning and calls)."""

    def __init__(self, tools: list[dict]):
        self.parser = HarmonyParser()
        self.calls = HarmonyCalls()

    def feed(self, text: str) -> ToolDelta:
        return self.calls.split(self.parser.feed(text))

    def finish(self) -> ToolDelta:
        return self.calls.split(self.parser.finish())
