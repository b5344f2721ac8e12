"""Ollama's answers: one JSON object with the whole text and its timings in nanoseconds, or NDJSON chunks ending in
that object; thinking and tool calls split out of the text by the request's output parser."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kv_bridge.protocol import DoneLine as Done

from gateway.api.ollama.protocol import Job
from gateway.api.ollama.errors import OLLAMA
from gateway.api.relay import Framing, ndjson
from gateway.errors import APIError
from gateway.text.output import OutputParser


@dataclass
class Clock:
    """Request arrival, generation start, first and last token (monotonic seconds) -> Ollama's ns durations."""

    t0: float
    t_gen: float = 0.0
    t_first: float | None = None
    t_end: float | None = None

    def token(self) -> None:
        if self.t_first is None:
            self.t_first = time.monotonic()

    def durations(self) -> dict[str, int]:
        end = self.t_end or time.monotonic()
        first = self.t_first or end
        t_gen = self.t_gen or self.t0
        ns = lambda s: max(0, int(s * 1e9))  # noqa: E731
        # The model is always resident; the gateway's own preparation (parse, template, tokenize) is the "load".
        return {"total_duration": ns(end - self.t0), "load_duration": ns(t_gen - self.t0),
                "prompt_eval_duration": ns(first - t_gen), "eval_duration": ns(end - first)}


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def chunk(job: Job, text: str, last: bool = False) -> dict:
    """One answer object; with a reasoning parser the text is split into `thinking` and the answer (`last`: the
    parser's held-back tail goes out too)."""
    thinking, calls = "", []
    if job.output is not None:
        d = job.output.feed(text)
        if last:
            rest = job.output.finish()
            d = type(d)(d.reasoning + rest.reasoning, d.content + rest.content, d.calls + rest.calls)
        text, thinking, calls = d.content, d.reasoning, _calls(job.output, d.calls)
    extra = {**({"thinking": thinking} if thinking else {}), **({"tool_calls": calls} if calls else {})}
    out: dict[str, Any] = {"model": job.name, "created_at": now_rfc3339()}
    if job.kind == "chat":
        out["message"] = {"role": "assistant", "content": text, **extra}
    else:
        out["response"] = text
        if thinking:
            out["thinking"] = thinking
    out["done"] = False
    return out


def _calls(output: OutputParser, calls: list) -> list[dict]:
    """Ollama's tool calls: each with its id and, in `function`, its index among the answer's calls (clients
    match parallel calls' results by them)."""
    first = output.calls - len(calls)  # the parser has counted these already
    out = []
    for i, c in enumerate(calls):
        call = c.ollama()
        out.append({"id": c.id, **call, "function": {"index": first + i, **call["function"]}})
    return out


def final(job: Job, text: str, done: Done, clock: Clock, generated: list[int]) -> dict:
    out = chunk(job, text, last=True)
    out.update(done=True, done_reason=done.finish_reason)
    if job.context:
        out["context"] = [*(job.prompt or []), *generated]
    d = clock.durations()
    out.update(total_duration=d["total_duration"], load_duration=d["load_duration"],
               prompt_eval_count=done.prompt_tokens, prompt_eval_duration=d["prompt_eval_duration"],
               eval_count=done.completion_tokens, eval_duration=d["eval_duration"])
    return out


class OllamaFraming(Framing):
    """Ollama's answer: one JSON object with the whole text and its timings, or NDJSON chunks ending in that object
    (a last `{"error": ...}` line when it fails mid-stream)."""

    stream_headers = {"Content-Type": "application/x-ndjson"}
    encode = staticmethod(ndjson)

    def __init__(self, job: Job, clock: Clock) -> None:
        self.job, self.clock = job, clock
        self.parts: list[str] = []
        self.ids: list[int] = []  # for `context`

    def _count(self, tok) -> None:
        self.clock.token()
        if tok.token_id >= 0:  # upstream tokens (-1) are not ours; they cannot go into `context`
            self.ids.append(tok.token_id)

    def keep(self, index: int, tok) -> None:
        self._count(tok)
        self.parts.append(tok.text)

    def ended(self, index: int, done) -> None:
        self.clock.t_end = time.monotonic()

    def body(self, dones: list) -> dict:
        return final(self.job, "".join(self.parts), dones[0], self.clock, self.ids)

    def token(self, index: int, tok) -> dict | None:
        self._count(tok)
        # A token that ends mid-codepoint has no text yet; the next one carries it.
        return chunk(self.job, tok.text) if tok.text else None

    def finish(self, index: int, done) -> dict:
        self.clock.t_end = time.monotonic()
        return final(self.job, "", done, self.clock, self.ids)

    def error(self, err: APIError) -> list[dict]:
        return [OLLAMA.body(err)]  # Ollama's mid-stream failure: a last line with "error", in its own words
