"""Constrained decoding on the decode node: JSON mode and JSON-schema outputs as an mlx-lm logits processor.

llguidance computes, per step, the tokens that keep the output inside the grammar; the rest are set to -inf. A
grammar may start only after the model's reasoning (`after`): the reasoning is free text, as in vLLM and Ollama.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from backends.common import NodeError

# Compact separators: a small model in JSON mode otherwise pads with whitespace until max_tokens runs out.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 64


class GrammarError(NodeError):
    """A format the engine cannot compile (a 400 naming the problem)."""

    def __init__(self, message: str):
        super().__init__(400, message, "invalid_grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to: any JSON object (schema None) or a JSON schema; `strict` refuses unsupported keywords
    instead of ignoring them; or `lark`, a grammar in llguidance's Lark dialect (the gateway's forced tool calls).
    Wire form: {"type": "json_object"} | {"type": "json_schema", "schema", "strict"} | {"type": "lark", "grammar"}."""

    schema: dict | None = None
    strict: bool = False
    lark: str | None = None
    after: tuple[str, ...] = ()  # free text until one of these ends the reasoning (`<|channel|>final<|message|>`)
    open: str | None = None  # with `after`: reasoning happens only if the output opens with this (`<think>`)

    @classmethod
    def from_response_format(cls, rf: dict | None) -> "GrammarSpec | None":
        """From OpenAI's `response_format` (None or type "text": no constraint)."""
        if not rf or rf.get("type") == "text":
            return None
        if rf.get("type") == "json_object":
            return cls()
        if rf.get("type") == "json_schema":
            js = rf.get("json_schema") or {}
            schema = js.get("schema", rf.get("schema"))
            if not isinstance(schema, dict):
                raise GrammarError("response_format json_schema needs a 'schema' object")
            return cls(schema=schema, strict=bool(js.get("strict", rf.get("strict", False))))
        raise GrammarError(f"response_format type {rf.get('type')!r} is not one of text, json_object, json_schema")

    @classmethod
    def from_ollama_format(cls, fmt) -> "GrammarSpec | None":
        """From Ollama's `format`: "" / None (none), "json" (any object) or a JSON schema object."""
        if fmt in (None, ""):
            return None
        if fmt == "json":
            return cls()
        if isinstance(fmt, dict):
            return cls(schema=fmt)
        raise GrammarError(f"format must be \"json\" or a JSON schema object, not {fmt!r}")

    def to_wire(self) -> dict:
        if self.lark is not None:
            out = {"type": "lark", "grammar": self.lark}
        elif self.schema is None:
            out = {"type": "json_object"}
        else:
            out = {"type": "json_schema", "schema": self.schema, "strict": self.strict}
        gate = {"after": list(self.after), "open": self.open} if self.after else {}
        return {**out, **{k: v for k, v in gate.items() if v}}

    @classmethod
    def from_wire(cls, value: dict | None) -> "GrammarSpec | None":
        if not value:
            return None
        spec = cls(lark=value.get("grammar")) if value.get("type") == "lark" else cls.from_response_format(value)
        return replace(spec, after=tuple(value.get("after") or ()), open=value.get("open") or None)

    def grammar(self) -> str:
        """The llguidance grammar text (raises GrammarError on a schema it cannot read)."""
        import llguidance

        if self.lark is not None:
            try:
                return llguidance.grammar_from("lark", self.lark)
            except (ValueError, TypeError, RuntimeError) as e:
                raise GrammarError(f"cannot compile the grammar: {e}") from None
        schema = {"type": "object"} if self.schema is None else self.schema
        options = {**_JSON_OPTIONS, "lenient": not self.strict}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"cannot compile the JSON schema: {e}") from None


class GrammarCompiler:
    """One per model: the llguidance view of its tokenizer (built once, about a second) and a cache of validated
    grammars. `n_vocab` is the width of the model's logits (it may exceed the tokenizer's vocabulary)."""

    def __init__(self, hf_tokenizer, n_vocab: int, eos_token_ids: list[int]):
        import llguidance.hf

        self.n_vocab = n_vocab
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=list(eos_token_ids))
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()  # the gateway-facing handler may validate while the MLX thread builds

    def compile(self, spec: GrammarSpec) -> str:
        """The grammar for `spec`, validated against this tokenizer; raises GrammarError naming the problem."""
        import llguidance

        key = json.dumps(replace(spec, after=(), open=None).to_wire(), sort_keys=True)  # the gate compiles nothing
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = spec.grammar()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            what = "grammar" if spec.lark is not None else "JSON schema"
            raise GrammarError(f"cannot compile the {what}: {messages[0] if messages else 'invalid'}")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def processor(self, spec: GrammarSpec, generated: list[int] = ()) -> "GrammarProcessor":
        """A fresh per-request processor. `generated`: tokens this request already produced elsewhere (a resumed
        generation after mid-stream failover), fed first so the grammar continues where it stopped."""
        proc = GrammarProcessor(self, self.compile(spec), spec.after, spec.open)
        for t in generated:
            proc.advance(int(t))
        if proc.matcher.is_error():
            raise GrammarError(f"the tokens generated so far do not fit the grammar: {proc.matcher.get_error()}")
        return proc


class GrammarProcessor:
    """A per-request mlx-lm logits processor, `(tokens, logits) -> logits` with logits (1, vocab).

    mlx-lm calls it once per generated token (stream_generate and BatchGenerator alike), with the tokens so far:
    the first call comes before any sampled token, every later call ends with the token sampled last.
    Once the grammar is complete only EOS stays allowed, so the generator stops on its own.
    With `after`, the output is free (reasoning) until its text contains one of those strings, and the grammar
    starts right after it; with `open` too, the first token decides: `open` starts reasoning, anything else starts
    the grammar (a model that does not think is constrained from its first token).
    """

    def __init__(self, compiler: GrammarCompiler, grammar: str, after: tuple[str, ...] = (), open: str | None = None):
        import llguidance

        self.matcher = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"cannot compile the JSON schema: {self.matcher.get_error()}")
        self.tokenizer = compiler.tokenizer
        self.n_vocab = compiler.n_vocab
        self.words = (compiler.n_vocab + 31) // 32
        self._bits = np.empty(self.words, dtype=np.int32)
        self._started = False
        self.eos = compiler.tokenizer.eos_tokens
        self.after = [a.encode() for a in after]
        open_ids = self.tokenizer.tokenize_str(open, parse_special=True) if open else []
        self.open_id = open_ids[0] if len(open_ids) == 1 else None  # an `open` that is not one token is not a gate
        # "constrained" | "first" (the next token decides) | "reasoning" (free until `after`)
        self.state = "constrained" if not after else "first" if self.open_id is not None else "reasoning"
        self._tail = b""  # the reasoning's last bytes: `after` may span tokens

    def advance(self, token: int) -> None:
        """Take one generated token."""
        if self.state == "first":
            self.state = "reasoning" if token == self.open_id else "constrained"
            if self.state == "reasoning":
                return
        if self.state == "constrained":
            self.matcher.consume_token(token)
            return
        self._tail += self.tokenizer.decode_bytes([token])
        ends = [(i + len(a), a) for a in self.after if (i := self._tail.find(a)) != -1]
        if not ends:
            self._tail = self._tail[-max(len(a) for a in self.after):]
            return
        self.state, rest = "constrained", self._tail[min(ends)[0]:]
        # A token that ends the reasoning and begins the answer: its answer part must fit the grammar too.
        if rest.strip() and not self.matcher.consume_tokens(self.tokenizer.tokenize_bytes(rest)):
            self.matcher.consume_token(self.eos[0] if self.eos else 0)  # leaves it in error: EOS only

    def __call__(self, tokens, logits):
        import mlx.core as mx

        if self._started:
            self.advance(int(tokens[-1]))
        self._started = True
        if self.state == "reasoning":
            return logits
        if self.matcher.is_error():  # cannot happen for a token we allowed; let the request end rather than loop
            allowed = np.zeros(self.n_vocab, dtype=bool)
            allowed[self.eos] = True
        else:
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)
        if self.state == "first":
            allowed[self.open_id] = True
        width = logits.shape[-1]
        if width != self.n_vocab:  # logits wider than the mask: the extra ids are padding, never allowed
            allowed = np.pad(allowed[:width], (0, max(0, width - self.n_vocab)))
        return mx.where(mx.array(allowed), logits, -mx.inf)

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting()
