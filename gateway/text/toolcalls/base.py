"""The tool-call parser interface and the call type every parser returns (OpenAI and Ollama shapes); parsers also
stream each call as pieces (its name first, then argument text) for OpenAI's tool-call deltas."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from gateway.text.markers import MarkerScanner


@dataclass
class ToolCall:
    """A parsed call: `arguments` is a JSON object text (OpenAI sends it as a string, Ollama as an object)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int) -> dict:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def ollama(self) -> dict:
        return {"function": {"name": self.name, "arguments": arguments_object(self.arguments)}}


@dataclass
class CallPiece:
    """A streamed part of a call: `call` numbers the calls of one output from 0; the first piece of a call carries
    its `id` and `name`, every piece a fragment of its arguments (the fragments join to ToolCall.arguments)."""

    call: int
    arguments: str
    name: str | None = None
    id: str | None = None


@dataclass
class ToolDelta:
    """What a fed chunk adds: text outside any call, calls completed in it, and the call pieces it streams."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    pieces: list[CallPiece] = field(default_factory=list)

    def add(self, other: "ToolDelta") -> "ToolDelta":
        return ToolDelta(self.content + other.content, self.calls + other.calls, self.pieces + other.pieces)


class ToolParser:
    """Text between `start` and `end` markers is held and parsed whole at `end`; outside text streams through.
    Subclasses implement `parse_call(body) -> list[ToolCall] | None` (None: malformed, the raw text is content)."""

    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self, tools: list[dict]):
        self.tools = {t.get("function", {}).get("name"): t.get("function", {}) for t in tools}
        self.scanner = MarkerScanner([self.start, self.end])
        self.inside = False
        self.body = ""
        self.released = 0  # calls parsed so far: the next one's number

    def feed(self, text: str) -> ToolDelta:
        return self._apply(self.scanner.feed(text))

    def finish(self) -> ToolDelta:
        d = self._apply(self.scanner.flush())
        if self.inside:  # cut off inside a call (max tokens): what came is text
            d.content += self.start + self.body
            self.inside, self.body = False, ""
        return d

    def _apply(self, pieces) -> ToolDelta:
        d = ToolDelta()
        for kind, s in pieces:
            if kind == "marker" and s == self.start and not self.inside:
                self.inside, self.body = True, ""
            elif kind == "marker" and s == self.end and self.inside:
                calls = self._safe_parse(self.body)
                if calls is None:
                    d.content += self.start + self.body + self.end
                else:
                    d.calls.extend(calls)
                    d.pieces.extend(whole_pieces(calls, self.released))
                    self.released += len(calls)
                self.inside, self.body = False, ""
            elif self.inside:
                self.body += s
            else:
                d.content += s
        return d

    def _safe_parse(self, body: str) -> list[ToolCall] | None:
        try:
            return self.parse_call(body)
        except (ValueError, TypeError, KeyError, AttributeError):  # a malformed call is text, never a 500
            return None

    def parse_call(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError


def arguments_text(args) -> str:
    """Arguments as a JSON object text; None when `args` is neither an object nor a JSON object text."""
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def arguments_object(arguments: str) -> dict:
    """Arguments text as Ollama's object: text that is not a JSON object (a model's invalid JSON, passed through as
    vLLM does) has no object form, and becomes {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def whole_pieces(calls: list[ToolCall], first: int) -> list[CallPiece]:
    """Calls parsed whole (at their end marker), as one piece each."""
    return [CallPiece(first + i, c.arguments, c.name, c.id) for i, c in enumerate(calls)]
