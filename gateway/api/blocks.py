"""One choice's output as an ordered list of blocks (reasoning, text, tool call), built token by token with the
events a block-structured API streams: a block starts, grows by deltas, stops. The Responses API (output items) and
Anthropic's Messages API (content blocks) both frame these, on `BlockFraming`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from kv_bridge.protocol import DoneLine, TokenLine

from gateway.api.relay import Framing
from gateway.text.output import OutputParser, Parts
from gateway.text.toolcalls import ToolCall

Kind = Literal["reasoning", "text", "call"]


@dataclass
class Block:
    kind: Kind
    text: str = ""  # reasoning or answer text; a call's arguments are in `call`
    call: ToolCall | None = None


@dataclass
class Event:
    """`start` (the block is empty), `delta` (text added; a call's whole arguments), or `stop` (the block is whole)."""

    type: Literal["start", "delta", "stop"]
    index: int
    block: Block
    delta: str = ""


class Blocks:
    """Feed token texts, then `finish`; each call returns the events it caused, and `blocks` is the whole output.
    Text that is only whitespace does not open a block by itself (the gap between reasoning and answer)."""

    def __init__(self, reasoning: str | None, tools: str | None, tool_list: list[dict] | None) -> None:
        self.parser = OutputParser(reasoning, tools, tool_list) if reasoning or tools else None
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._pending = ""  # leading whitespace of a text block not opened yet
        self.reasoning_tokens = 0

    def feed(self, text: str) -> list[Event]:
        parts = self.parser.feed(text) if self.parser else Parts(content=text)
        if parts.reasoning and not parts.content:
            self.reasoning_tokens += 1
        return self._apply(parts)

    def finish(self, stopped: bool = True) -> list[Event]:
        """`stopped`: the model ended its turn (not cut off by max tokens)."""
        out = self._apply(self.parser.finish(stopped)) if self.parser else []
        return out + self._close()

    @property
    def calls(self) -> list[ToolCall]:
        return [b.call for b in self.blocks if b.call is not None]

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "text")

    def _apply(self, p: Parts) -> list[Event]:
        out: list[Event] = []
        if p.reasoning:
            out += self._grow("reasoning", p.reasoning)
        if p.content:
            out += self._grow("text", p.content)
        for call in p.calls:
            out += self._close()
            block = Block("call", call=call)
            self.blocks.append(block)
            i = len(self.blocks) - 1
            out += [Event("start", i, block), Event("delta", i, block, call.arguments), Event("stop", i, block)]
        return out

    def _grow(self, kind: Kind, text: str) -> list[Event]:
        out: list[Event] = []
        if self._open is None or self._open.kind != kind:
            if kind == "text" and not (self._pending + text).strip():
                self._pending += text
                return []
            out += self._close()
            if kind == "text":
                text, self._pending = self._pending + text, ""
            self._open = Block(kind)
            self.blocks.append(self._open)
            out.append(Event("start", len(self.blocks) - 1, self._open))
        self._open.text += text
        out.append(Event("delta", len(self.blocks) - 1, self._open, text))
        return out

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [Event("stop", self.blocks.index(block), block)]


class BlockFraming(Framing):
    """What a block-structured API's framing shares: one choice's `Blocks`, fed token by token, and server-sent
    events named by their type. Each API writes only its own shapes: `_events` (a stream's events for the blocks'
    events), `body`, `opening`, `closing`, `error`."""

    stream_headers = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    waiting = b": queued\n\n"

    def __init__(self, blocks: Blocks) -> None:
        self.blocks = blocks

    def encode(self, frame: list[dict]) -> bytes:
        return b"".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n".encode() for e in frame)

    def _events(self, events: list[Event]) -> list[dict]:
        raise NotImplementedError

    # ---- complete ----

    def keep(self, index: int, tok: TokenLine) -> None:
        self.blocks.feed(tok.text)

    def ended(self, index: int, done: DoneLine) -> None:
        self.blocks.finish(done.finish_reason == "stop")

    # ---- streamed ----

    def token(self, index: int, tok: TokenLine) -> list[dict] | None:
        return self._events(self.blocks.feed(tok.text)) or None

    def finish(self, index: int, done: DoneLine) -> list[dict] | None:
        return self._events(self.blocks.finish(done.finish_reason == "stop")) or None
