"""One choice's generated text split for the client: reasoning, answer text and tool calls, streamed (feed per token
text, then finish) through the model's reasoning parser and, when the request has tools, its tool-call parser."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kv_bridge.config.models import ModelRoute
from kv_bridge.config.source import ConfigError
from kv_bridge.families import output_family

from gateway.text.reasoning import REASONING_PARSERS, Delta, HarmonyParser, reasoning_parser
from gateway.text.toolcalls import PARSERS, ToolCall, tool_parser
from gateway.text.toolcalls.base import CallPiece
from gateway.text.toolcalls.harmony import HarmonyCalls


def tool_parser_name(configured: str | None, model_type: str | None) -> str | None:
    """The tool-call parser of a model's output, or None: config.toml `tool_parser` ("none": no parsing), else its
    family's default (kv_bridge/families)."""
    name = configured if configured is not None else output_family(model_type).tool_parser
    return None if name in (None, "none") else name


def check_parsers(routes: Iterable[ModelRoute]) -> None:
    """At start-up: each model's configured `reasoning_parser` and `tool_parser` names a parser of the registries
    (REASONING_PARSERS, toolcalls.PARSERS) or "none"; raises ConfigError naming the choices."""
    for r in routes:
        for key, name, registry in (("reasoning_parser", r.reasoning_parser, REASONING_PARSERS),
                                    ("tool_parser", r.tool_parser, PARSERS)):
            if name is not None and name != "none" and name not in registry:
                raise ConfigError(f"model {r.id!r}: {key} {name!r} is not a known parser; set it to one of "
                                  f"{', '.join(sorted(registry))} or \"none\", or leave it out for the model "
                                  f"family's default")


@dataclass
class Parts:
    """`calls`: calls completed in this chunk; `pieces`: the calls as they stream (name first, then arguments)."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    pieces: list[CallPiece] = field(default_factory=list)


class OutputParser:
    """`reasoning`: a reasoning parser's name or None; `tools`: a tool-call parser's name, None when the request
    has no tools (calls are then left as text). harmony's calls come from the reasoning parser's messages."""

    def __init__(self, reasoning: str | None, tools: str | None = None, tool_list: list[dict] | None = None):
        self.reasoning = reasoning_parser(reasoning) if reasoning else None
        self.harmony_calls = HarmonyCalls() if tools == "harmony" else None
        self.tools = tool_parser(tools, tool_list) if tools and tools != "harmony" else None
        self.calls = 0  # calls completed so far

    def feed(self, text: str) -> Parts:
        return self._split(self.reasoning.feed(text) if self.reasoning else Delta(content=text), last=False)

    def finish(self, stopped: bool = True) -> Parts:
        """The held-back tail. `stopped`: the model ended its turn (an EOS token, whose text the node does not
        send): a harmony message to a recipient still open then ended with <|call|>, not a cut-off."""
        d = Delta()
        r = self.reasoning
        if stopped and isinstance(r, HarmonyParser) and r.state == "message" and r.recipient:
            d = r.feed("<|call|>")
        return self._split(d.add(r.finish()) if r else d, last=True)

    def whole(self, text: str, stopped: bool = True) -> Parts:
        a, b = self.feed(text), self.finish(stopped)
        return Parts(a.reasoning + b.reasoning, a.content + b.content, a.calls + b.calls, a.pieces + b.pieces)

    def _split(self, d: Delta, last: bool) -> Parts:
        content, calls, pieces = d.content, [], []
        if self.harmony_calls is not None:
            td = self.harmony_calls.split(d)
            content, calls, pieces = td.content, td.calls, td.pieces
        elif self.tools is not None:
            td = self.tools.feed(content)
            if last:
                td = td.add(self.tools.finish())
            content, calls, pieces = td.content, td.calls, td.pieces
        self.calls += len(calls)
        return Parts(d.reasoning, content, calls, pieces)
