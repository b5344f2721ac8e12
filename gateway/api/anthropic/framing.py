"""Anthropic Messages answers: a `message` with content blocks (thinking, text, tool_use), or the documented
server-sent events (`message_start`, `content_block_start`/`_delta`/`_stop`, `message_delta`, `message_stop`)
built from gateway.api.blocks' events."""

from __future__ import annotations

import json
import uuid
from typing import Callable

from kv_bridge.protocol import DoneLine, TokenLine

from gateway.api.blocks import Block, BlockFraming, Blocks, Event
from gateway.errors import APIError

from gateway.api.anthropic.errors import error_body


def content_block(block: Block, whole: bool = True) -> dict:
    """A block as Anthropic writes it; not `whole`: as `content_block_start` opens it, empty."""
    if block.kind == "call":
        c = block.call
        return {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments) if whole else {}}
    if block.kind == "reasoning":  # no signature: nothing here verifies one; clients send it back as they got it
        return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
    return {"type": "text", "text": block.text if whole else ""}


def _delta(block: Block, text: str) -> dict:
    if block.kind == "call":
        return {"type": "input_json_delta", "partial_json": text}
    if block.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": text}
    return {"type": "text_delta", "text": text}


class AnthropicFraming(BlockFraming):
    def __init__(self, model: str, blocks: Blocks, prompt_tokens: int, stops: list[str],
                 decode: Callable[[list[int]], str]) -> None:
        super().__init__(blocks)
        self.model, self.prompt_tokens = model, prompt_tokens
        self.stops, self.decode = stops, decode  # to tell which stop sequence ended the turn
        self.id = f"msg_{uuid.uuid4().hex}"
        self.ids: list[int] = []

    def _stop(self, done: DoneLine) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence). The node leaves a stop string out of the text; the ids still hold it."""
        if done.finish_reason == "length":
            return "max_tokens", None
        if self.blocks.calls:
            return "tool_use", None
        if self.stops and self.ids and min(self.ids) >= 0:  # upstream tokens (-1) are not ours to decode
            full = self.decode(self.ids)
            hits = sorted((full.find(s), s) for s in self.stops if s in full)
            if hits:
                return "stop_sequence", hits[0][1]
        return "end_turn", None

    def _usage(self, done: DoneLine | None) -> dict:
        return {"input_tokens": self.prompt_tokens, "output_tokens": done.completion_tokens if done else 0,
                "cache_read_input_tokens": done.prefix_tokens if done else 0, "cache_creation_input_tokens": 0}

    def message(self, done: DoneLine | None) -> dict:
        reason, seq = self._stop(done) if done else (None, None)
        content = [content_block(b) for b in self.blocks.blocks] if done else []
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": seq, "usage": self._usage(done)}

    # ---- complete ----

    def keep(self, index: int, tok: TokenLine) -> None:
        self.ids.append(tok.token_id)  # to tell which stop sequence ended the turn
        super().keep(index, tok)

    def body(self, dones: list[DoneLine]) -> dict:
        return self.message(dones[0])

    # ---- streamed ----

    def opening(self, n: int) -> list[list[dict]]:
        return [[{"type": "message_start", "message": self.message(None)}, {"type": "ping"}]]

    def token(self, index: int, tok: TokenLine) -> list[dict] | None:
        self.ids.append(tok.token_id)
        return super().token(index, tok)

    def finish(self, index: int, done: DoneLine) -> list[dict]:
        out = super().finish(index, done) or []
        reason, seq = self._stop(done)
        return out + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                       "usage": {"output_tokens": done.completion_tokens}}]

    def closing(self, dones: list[DoneLine]) -> list[list[dict]]:
        return [[{"type": "message_stop"}]]

    def error(self, err: APIError) -> list[list[dict]]:
        return [[error_body(err)]]

    def _events(self, events: list[Event]) -> list[dict]:
        out = []
        for ev in events:
            if ev.type == "start":
                out.append({"type": "content_block_start", "index": ev.index,
                            "content_block": content_block(ev.block, whole=False)})
            elif ev.type == "delta":
                out.append({"type": "content_block_delta", "index": ev.index, "delta": _delta(ev.block, ev.delta)})
            else:
                out.append({"type": "content_block_stop", "index": ev.index})
        return out
