"""Streaming split of generated text into reasoning and final content: harmony channels (gpt-oss) and
`<think>` blocks (Qwen3 family). Parsers read text, so every path (node tokens, failover, upstream) feeds them alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_bridge.families import output_family

from gateway.text.markers import MarkerScanner

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
HARMONY_STOPS = ("<|return|>", "<|call|>")  # harmony's end-of-turn tokens: generation stops on either


@dataclass
class HarmonyMessage:
    """A complete harmony message the model addressed to a recipient (a tool call: `to=functions.NAME`)."""

    recipient: str
    channel: str
    content_type: str
    body: str
    number: int = 0  # the output's tool-addressed messages, counted from 0 (matches Delta.pieces)


@dataclass
class Delta:
    """What one fed chunk adds: reasoning text, final content text, finished tool-addressed messages, and those
    messages as they stream: (message number, recipient, body text), the first of each with empty text."""

    reasoning: str = ""
    content: str = ""
    messages: list[HarmonyMessage] = field(default_factory=list)
    pieces: list[tuple[int, str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.messages or self.pieces)

    def add(self, other: "Delta") -> "Delta":
        return Delta(self.reasoning + other.reasoning, self.content + other.content, self.messages + other.messages,
                     self.pieces + other.pieces)


class ThinkParser:
    """`<think>reasoning</think>content`. `start_in_reasoning`: the prompt already opened the block (templates that
    end the generation prompt with `<think>`), so output starts as reasoning and only `</think>` follows."""

    def __init__(self, start_in_reasoning: bool = False, open_tag: str = "<think>", close_tag: str = "</think>"):
        self.open, self.close = open_tag, close_tag
        self.scanner = MarkerScanner([open_tag, close_tag])
        self.thinking = start_in_reasoning
        self.seen_text = start_in_reasoning  # a <think> after real content is content, not a new block

    def feed(self, text: str) -> Delta:
        return self._apply(self.scanner.feed(text))

    def finish(self) -> Delta:
        return self._apply(self.scanner.flush())

    def _apply(self, pieces) -> Delta:
        d = Delta()
        for kind, s in pieces:
            if kind == "marker" and s == self.open and not self.thinking and not self.seen_text:
                self.thinking = True
            elif kind == "marker" and s == self.close and self.thinking:
                self.thinking, self.seen_text = False, True
            elif self.thinking:
                d.reasoning += s
            else:
                if not self.seen_text and s.strip():
                    self.seen_text = True
                d.content += s
        return d


class HarmonyParser:
    """gpt-oss harmony output: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
    <|message|>...<|return|>`. analysis -> reasoning, final -> content; a message with a recipient
    (`commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`) streams in `pieces` and comes back
    whole in `messages`; commentary without one is preamble text shown as content. The prompt ends with
    `<|start|>assistant`, so output opens inside a header. No markup reaches content or reasoning: a stray marker in
    a body is dropped, a header cut off is dropped, and a message cut off (max tokens) still ends."""

    def __init__(self):
        self.scanner = MarkerScanner(HARMONY_MARKERS)
        self.state = "header"  # header | message | done-message (between <|end|> and the next <|start|>)
        self.header = ""
        self.body = ""
        self.channel = self.recipient = self.content_type = ""
        self.addressed = 0  # tool-addressed messages opened so far

    def feed(self, text: str) -> Delta:
        return self._apply(self.scanner.feed(text))

    def finish(self) -> Delta:
        d = self._apply(self.scanner.flush())
        if self.state == "message" and self.recipient:  # cut off inside a call: it ends with what came
            self._close_message(d)
        elif self.state == "header" and self.header.strip() and "<|" not in self.header and not self.channel:
            d.content += self.header  # no harmony at all: plain text is the answer
        return d

    def _apply(self, pieces) -> Delta:
        d = Delta()
        for kind, s in pieces:
            if kind == "text":
                self._text(s, d)
            elif s == "<|message|>" and self.state == "header":
                self._open_message(d)
            elif s in ("<|end|>", "<|return|>", "<|call|>") and self.state == "message":
                self._close_message(d)
            elif s == "<|start|>":
                self.state, self.header, self.channel = "header", "", ""
            elif s == "<|channel|>" and self.state in ("message", "done"):  # a header without <|end|><|start|>
                if self.state == "message":
                    self._close_message(d)
                self.state, self.header = "header", " <|channel|> "
            elif s in ("<|channel|>", "<|constrain|>") and self.state == "header":
                self.header += " " + s + " "
        return d

    def _text(self, s: str, d: Delta) -> None:
        if self.state == "header":
            self.header += s
        elif self.state == "message" and self.recipient:
            self.body += s
            d.pieces.append((self.addressed, self.recipient, s))
        elif self.state == "message" and self.channel == "analysis":
            d.reasoning += s
        elif self.state == "message":
            d.content += s

    def _open_message(self, d: Delta) -> None:
        channel, recipient, ctype = parse_header(self.header)
        self.channel, self.recipient, self.content_type = channel, recipient, ctype
        self.state, self.body = "message", ""
        if recipient:
            d.pieces.append((self.addressed, recipient, ""))

    def _close_message(self, d: Delta) -> None:
        if self.recipient:
            d.messages.append(HarmonyMessage(self.recipient, self.channel, self.content_type, self.body,
                                             self.addressed))
            self.addressed += 1
        self.state, self.header, self.body, self.recipient = "done", "", "", ""


def parse_header(header: str) -> tuple[str, str, str]:
    """(channel, recipient, content type) from a harmony header such as
    `assistant <|channel|> commentary to=functions.f <|constrain|> json` (`to=` may also precede the channel)."""
    words = header.replace("<|channel|>", " <|channel|> ").replace("<|constrain|>", " <|constrain|> ").split()
    channel = recipient = ctype = ""
    for i, w in enumerate(words):
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if w == "<|channel|>":
            channel = nxt
        elif w == "<|constrain|>":
            ctype = nxt
        elif w.startswith("to="):
            recipient = w[3:]
    return channel, recipient, ctype


EFFORTS = ("low", "medium", "high")


def template_kwargs(parser: str, reasoning_effort: str | None = None, think: bool | str | None = None) -> dict:
    """Chat-template kwargs for a request's reasoning settings (OpenAI `reasoning_effort`, Ollama `think`: true,
    false or an effort). harmony takes `reasoning_effort` and cannot switch reasoning off (false -> "low");
    `<think>` templates take `enable_thinking`. Raises ValueError on an effort that is not low, medium or high."""
    effort = think if isinstance(think, str) else reasoning_effort
    if effort is not None and effort not in EFFORTS:
        raise ValueError(f"reasoning effort must be one of {', '.join(EFFORTS)}, not {effort!r}")
    if parser == "harmony":
        if effort is None and think is False:
            effort = "low"
        return {} if effort is None else {"reasoning_effort": effort}
    if parser == "think":
        return {} if think is None and effort is None else {"enable_thinking": think is not False}
    return {}


# Where a final answer begins: structured output constrains only what follows (vLLM's harmony structural tag takes
# the same headers: plain, `json` and `<|constrain|>json`).
HARMONY_FINAL = ("<|channel|>final<|message|>", "<|channel|>final json<|message|>",
                 "<|channel|>final <|constrain|>json<|message|>")


def gate_grammar(grammar: dict | None, parser: str | None, prompt_tail: str) -> dict | None:
    """A JSON grammar that starts after the model's reasoning, as vLLM and Ollama constrain thinking models: harmony
    after its final-channel header, `<think>` models after `</think>` (when the output opens a block, or the prompt
    did). `prompt_tail`: the prompt's last text; a prompt that already ended the reasoning is constrained at once.
    Forced tool-call grammars (lark) already admit the reasoning and are left as they are."""
    if not grammar or grammar.get("type") == "lark" or parser not in ("harmony", "think"):
        return grammar
    tail = prompt_tail.rstrip()
    if parser == "harmony":
        return grammar if tail.endswith(HARMONY_FINAL) else {**grammar, "after": list(HARMONY_FINAL)}
    if tail.endswith("</think>"):
        return grammar
    return {**grammar, "after": ["</think>"], **({} if tail.endswith("<think>") else {"open": "<think>"})}


REASONING_PARSERS = {"harmony": HarmonyParser, "think": ThinkParser}


def parser_name(configured: str | None, model_type: str | None) -> str | None:
    """The reasoning parser a model's output goes through, or None: config.toml `reasoning_parser` ("none": no split),
    else its family's default (kv_bridge/families)."""
    name = configured if configured is not None else output_family(model_type).reasoning_parser
    return None if name in (None, "none") else name


def reasoning_parser(name: str, **kwargs):
    """A fresh parser of the registered format `name`; an unknown name is a ValueError listing the known ones."""
    try:
        cls = REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None
    return cls(**kwargs)
