"""OpenAI response shapes: `chat.completion` / `chat.completion.chunk` and `text_completion` (whole and streamed).

A renderer turns one request's choices into JSON. Streams: `opening()` once, `token()` per token (None: send
nothing), `finish()` per choice, `usage_chunk()` last when the client asked for usage. Whole: `body()`.
Logprobs: a token's `bytes` are its exact UTF-8 bytes (a byte-level BPE token may hold half a character); its
`token` string is those bytes decoded, or escaped like OpenAI's (`\\xe6\\x97`) when they are not whole characters.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache

from tokenizers import Tokenizer, decoders

from kv_bridge.protocol import DoneLine
from kv_bridge.protocol import TokenLine as Token

from gateway.errors import APIError
from gateway.text.output import OutputParser, Parts
from gateway.api.relay import Framing, sse
from gateway.api.openai.protocol import usage


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, inverted (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenPieces:
    """Per-id token strings and bytes for one tokenizer, cached (a vocabulary is small; requests repeat ids)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._tok.id_to_token(token_id)
        table = _byte_decoder()
        if raw is not None and self._byte_level and all(c in table for c in raw):
            data = bytes(table[c] for c in raw)
        else:  # special tokens and non-byte-level vocabularies: the decoder's own text
            data = self._tok.decode([token_id], skip_special_tokens=False).encode()
        return data.decode("utf-8", errors="backslashreplace"), list(data)

    def text(self, token_id: int) -> str:
        return self.piece(token_id)[0]


def chat_item(pieces: TokenPieces, tok: Token) -> dict:
    """One entry of chat `choices[i].logprobs.content`."""
    text, data = pieces.piece(tok.token_id)
    top = []
    for tid, lp in tok.top_logprobs or []:
        t, b = pieces.piece(tid)
        top.append({"token": t, "logprob": lp, "bytes": b})
    return {"token": text, "logprob": tok.logprob, "bytes": data, "top_logprobs": top}


class CompletionLogprobs:
    """The legacy completions `logprobs` object, built token by token; `text_offset` counts from the
    completion's first character."""

    def __init__(self, pieces: TokenPieces) -> None:
        self.pieces = pieces
        self.offset = 0

    def entry(self, tok: Token) -> dict:
        """The logprobs object for one token (a stream chunk's), advancing the text offset."""
        text = self.pieces.text(tok.token_id)
        top = {}
        for tid, lp in tok.top_logprobs or []:
            top.setdefault(self.pieces.text(tid), lp)  # two ids can share a string; keep the likelier
        out = {"tokens": [text], "token_logprobs": [tok.logprob], "top_logprobs": [top], "text_offset": [self.offset]}
        self.offset += len(text)
        return out

    def merge(self, toks: list[Token]) -> dict:
        """The logprobs object for a whole completion."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok in toks:
            for key, values in self.entry(tok).items():
                out[key] += values
        return out


@dataclass
class ChoiceResult:
    """One finished choice of a non-streamed request."""

    index: int
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str = "stop"

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


class _Renderer:
    object = ""
    chunk_object = ""
    prefix = ""

    def __init__(self, model: str, pieces: TokenPieces, include_usage: bool) -> None:
        self.model, self.pieces, self.include_usage = model, pieces, include_usage
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    def _chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        # With include_usage every chunk carries `usage`: null until the last one.
        out = {**self._head(self.chunk_object), "choices": choices}
        if self.include_usage:
            out["usage"] = use
        return out

    def usage_chunk(self, use: dict) -> dict:
        return self._chunk([], use)

    def opening(self, n: int) -> list[dict]:
        return []


class ChatRenderer(_Renderer):
    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, model: str, pieces: TokenPieces, include_usage: bool, logprobs: bool,
                 reasoning: str | None = None, tools: str | None = None, tool_list: list[dict] | None = None) -> None:
        super().__init__(model, pieces, include_usage)
        self.logprobs = logprobs
        # Parser names (gateway.text.reasoning, gateway.text.toolcalls); both None: all text is content, as it comes.
        self.reasoning, self.tools, self.tool_list = reasoning, tools, tool_list
        self._parsers: dict[int, OutputParser] = {}

    @property
    def splits(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def _parser(self, index: int) -> OutputParser:
        if index not in self._parsers:
            self._parsers[index] = OutputParser(self.reasoning, self.tools, self.tool_list)
        return self._parsers[index]

    @staticmethod
    def _parts(p: Parts, after_call: bool = False) -> dict:
        """Parsed parts as delta fields: reasoning under both names clients read (vLLM's old and new), and calls
        as vLLM streams them: id, type and name first, then argument fragments, each by its call's index."""
        out: dict = {"reasoning_content": p.reasoning, "reasoning": p.reasoning} if p.reasoning else {}
        if p.content and (p.content.strip() or not after_call):  # whitespace after a call is no content
            out["content"] = p.content
        calls: list[dict] = []
        for piece in p.pieces:
            if piece.name is None and calls and calls[-1]["index"] == piece.call:
                calls[-1]["function"]["arguments"] += piece.arguments
            elif piece.name is None:
                calls.append({"index": piece.call, "function": {"arguments": piece.arguments}})
            else:
                calls.append({"index": piece.call, "id": piece.id, "type": "function",
                              "function": {"name": piece.name, "arguments": piece.arguments}})
        if calls:
            out["tool_calls"] = calls
        return out

    def _delta(self, index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> dict:
        return self._chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

    def opening(self, n: int) -> list[dict]:
        return [self._delta(i, {"role": "assistant", "content": ""}) for i in range(n)]

    def token(self, index: int, tok: Token) -> dict | None:
        delta = {"content": tok.text} if not self.splits else self._feed(index, tok.text, last=False)
        if self.logprobs:  # every token gets its chunk, even one whose text is still held back
            return self._delta(index, delta, {"content": [chat_item(self.pieces, tok)]})
        if not any(delta.values()):  # a token that ends mid-codepoint (or a marker) has no text yet
            return None
        return self._delta(index, delta)

    def _feed(self, index: int, text: str, last: bool, stopped: bool = True) -> dict:
        p = self._parser(index)
        after_call = p.calls > 0
        return self._parts(p.finish(stopped) if last else p.feed(text), after_call)

    def finish(self, index: int, reason: str) -> dict:
        rest = {} if not self.splits else self._feed(index, "", True, reason == "stop")
        if self.splits and self._parser(index).calls and reason == "stop":
            reason = "tool_calls"
        return self._delta(index, rest, None, reason)

    def _message(self, r: ChoiceResult) -> tuple[dict, str]:
        if not self.splits:
            return {"role": "assistant", "content": r.text}, r.finish_reason
        p = OutputParser(self.reasoning, self.tools, self.tool_list).whole(r.text, r.finish_reason == "stop")
        # Beside calls, whitespace between them is no answer (content null, as vLLM).
        content = (p.content.strip() or None) if p.calls else p.content
        msg: dict = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = msg["reasoning"] = p.reasoning or None
        if p.calls:
            msg["tool_calls"] = [{k: v for k, v in c.openai(i).items() if k != "index"} for i, c in enumerate(p.calls)]
        return msg, "tool_calls" if p.calls and r.finish_reason == "stop" else r.finish_reason

    def body(self, results: list[ChoiceResult], use: dict) -> dict:
        choices = []
        for r in results:
            msg, finish = self._message(r)
            choices.append({
                "index": r.index, "message": msg,
                "logprobs": {"content": [chat_item(self.pieces, t) for t in r.tokens]} if self.logprobs else None,
                "finish_reason": finish,
            })
        return {**self._head(self.object), "choices": choices, "usage": use}


class CompletionRenderer(_Renderer):
    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, model: str, pieces: TokenPieces, include_usage: bool, logprobs: bool) -> None:
        super().__init__(model, pieces, include_usage)
        self.logprobs = logprobs
        self._offsets: dict[int, CompletionLogprobs] = {}

    def _choice(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def token(self, index: int, tok: Token) -> dict | None:
        if self.logprobs:
            lp = self._offsets.setdefault(index, CompletionLogprobs(self.pieces)).entry(tok)
            return self._chunk([self._choice(index, tok.text, lp, None)])
        if not tok.text:
            return None
        return self._chunk([self._choice(index, tok.text, None, None)])

    def finish(self, index: int, reason: str) -> dict:
        return self._chunk([self._choice(index, "", None, reason)])

    def body(self, results: list[ChoiceResult], use: dict) -> dict:
        choices = [
            self._choice(r.index, r.text, CompletionLogprobs(self.pieces).merge(r.tokens) if self.logprobs else None,
                         r.finish_reason)
            for r in results
        ]
        return {**self._head(self.object), "choices": choices, "usage": use}


class OpenAIFraming(Framing):
    """OpenAI's answer: `renderer.body` as JSON, or its chunks as server-sent events ending in `[DONE]`."""

    stream_headers = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    waiting = b": queued\n\n"
    encode = staticmethod(sse)

    def __init__(self, renderer: ChatRenderer | CompletionRenderer) -> None:
        self.renderer = renderer
        self._kept: dict[int, list[Token]] = {}

    def keep(self, index: int, tok: Token) -> None:
        self._kept.setdefault(index, []).append(tok)

    def body(self, dones: list[DoneLine]) -> dict:
        results = [ChoiceResult(i, self._kept.get(i, []), d.finish_reason) for i, d in enumerate(dones)]
        return self.renderer.body(results, _usage(dones))

    def opening(self, n: int) -> list[dict]:
        return self.renderer.opening(n)

    def token(self, index: int, tok: Token) -> dict | None:
        return self.renderer.token(index, tok)

    def finish(self, index: int, done: DoneLine) -> dict:
        return self.renderer.finish(index, done.finish_reason)

    def closing(self, dones: list[DoneLine]) -> list:
        return [self.renderer.usage_chunk(_usage(dones)), "[DONE]"] if self.renderer.include_usage else ["[DONE]"]

    def error(self, err: APIError) -> list:
        return [err.body(), "[DONE]"]


def _usage(dones: list[DoneLine]) -> dict:
    # The prompt is counted once, as OpenAI does for n > 1; completions add up.
    return usage(dones[0].prompt_tokens, sum(d.completion_tokens for d in dones))
