"""The gateway<->decode-node messages (docs/protocol.md): one `Sampling` both sides parse, the typed token and done
lines of the NDJSON stream, and the path and fallback names. Pure Python: the gateway imports it too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

MAX_TOP_LOGPROBS = 20  # alternatives per token a client may ask for
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
SEED_SPACE = 1 << 64  # seeds are unsigned 64-bit (mx.random.seed)
DEFAULT_MAX_TOKENS = 256


class ProtocolError(ValueError):
    """A message that breaks the protocol; each side translates it at its boundary (400 on a node, 502 on the
    gateway)."""


# A client's per-request switch for the decode node's speculative decoding (docs/speculative.md): "off" decodes the
# request plainly, "on" (or no header) as the model's config says. The gateway forwards it as Sampling.speculative.
SPECULATIVE_HEADER = "x-disagg-speculative"
SPECULATIVE_VALUES = {"on": True, "off": False}


def speculative_from_header(value: str | None) -> bool:
    """The header's value as Sampling.speculative; ProtocolError on anything but on/off."""
    if value is None:
        return True
    got = SPECULATIVE_VALUES.get(value.strip().lower())
    if got is None:
        raise ProtocolError(f"{SPECULATIVE_HEADER} must be 'on' or 'off', not {value!r}")
    return got


def _switch(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"speculative must be true or false, not {value!r}")
    return value


class Path(StrEnum):
    """How a request was served (the x-disagg-path header, the `path` metric label)."""

    DISAGGREGATED = "disaggregated"
    LOCAL = "local"
    FALLBACK = "fallback"
    UPSTREAM = "upstream"


class Fallback(StrEnum):
    """A fallback step (x-disagg-fallbacks, disagg_fallbacks_total{reason}); the kv_* ones come from the decode node's
    done line, the others from the gateway."""

    DECODE_NODE_FAILED = "decode_node_failed"
    DECODE_NODE_BUSY = "decode_node_busy"
    DECODE_FAILOVER = "decode_failover"
    PREFILL_NODE_FAILED = "prefill_node_failed"
    KV_TIMEOUT = "kv_timeout"
    KV_ERROR = "kv_error"
    KV_ABORTED = "kv_aborted"
    KV_FIDELITY = "kv_fidelity"  # the KV arrived but its layer 0 is not the prompt's (the real-traffic check)
    UPSTREAM = "upstream"
    NO_CAPACITY = "no_capacity"


@dataclass(frozen=True)
class Sampling:
    """What the decode node samples with: the sampling part of a /v1/generate body. The gateway builds it from a
    validated client request; the node parses it with `from_json`, which checks every limit."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> additive bias
    logprobs: int | None = None  # alternatives per token to report; None: no logprobs at all
    # Constrained decoding: None, {"type": "json_object"} or {"type": "json_schema", "schema": {...}, "strict": b}
    # or {"type": "lark", "grammar": text}; "after": [texts] starts it only after the reasoning ends with one of them,
    # "open": the token that must open that reasoning (else it is constrained from the start).
    grammar: dict | None = None
    grammar_generated: int = 0  # the prompt's last N tokens were generated under `grammar` (a resumed generation)
    speculative: bool = True  # False: the node decodes this request plainly (SPECULATIVE_HEADER; `disagg bench spec`)

    def to_json(self) -> dict:
        """The body fields (JSON object keys are strings: logit_bias token ids go as decimal strings)."""
        out = asdict(self)
        out["logit_bias"] = {str(t): b for t, b in self.logit_bias.items()}
        return out

    @classmethod
    def from_json(cls, body: dict) -> "Sampling":
        """From a /v1/generate body; absent fields take the defaults. Raises ProtocolError on a bad value."""
        def num(key: str, default, kind=float):
            value = body.get(key)
            return default if value is None else kind(value)

        try:
            seed = body.get("seed")
            p = cls(max_tokens=num("max_tokens", DEFAULT_MAX_TOKENS, int), temperature=num("temperature", 0.0),
                    top_p=num("top_p", 1.0), seed=None if seed is None else int(seed) % SEED_SPACE,
                    stop=list(body.get("stop") or []), top_k=num("top_k", 0, int), min_p=num("min_p", 0.0),
                    presence_penalty=num("presence_penalty", 0.0), frequency_penalty=num("frequency_penalty", 0.0),
                    repetition_penalty=num("repetition_penalty", 1.0),
                    logit_bias={int(k): float(v) for k, v in (body.get("logit_bias") or {}).items()},
                    logprobs=num("logprobs", None, int), grammar=body.get("grammar") or None,
                    grammar_generated=num("grammar_generated", 0, int),
                    speculative=_switch(body.get("speculative", True)))
        except (TypeError, ValueError, AttributeError) as e:
            raise ProtocolError(f"bad sampling parameter: {e}") from None
        p.check()
        return p

    def check(self) -> None:
        """Every limit of the protocol; raises ProtocolError naming each one broken."""
        floats = (self.temperature, self.top_p, self.min_p, self.presence_penalty, self.frequency_penalty,
                  self.repetition_penalty, *self.logit_bias.values())
        if not all(math.isfinite(v) for v in floats):
            raise ProtocolError("sampling parameters must be finite numbers")
        pen = MAX_PENALTY
        rules = [
            (self.max_tokens >= 1, "max_tokens >= 1"), (self.temperature >= 0, "temperature >= 0"),
            (0 < self.top_p <= 1, "0 < top_p <= 1"), (self.top_k >= 0, "top_k >= 0"),
            (0 <= self.min_p <= 1, "0 <= min_p <= 1"),
            (abs(self.presence_penalty) <= pen and abs(self.frequency_penalty) <= pen, "penalties in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty > 0"),
            (all(t >= 0 and abs(b) <= MAX_LOGIT_BIAS for t, b in self.logit_bias.items()),
             "logit_bias maps token ids >= 0 to biases in [-100, 100]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS, f"logprobs in [0, {MAX_TOP_LOGPROBS}]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop is a list of non-empty strings"),
            (grammar_ok(self.grammar), 'grammar is {"type": "json_object"}, {"type": "json_schema", "schema": {}} or '
                                       '{"type": "lark", "grammar": "..."}, optionally with "after": ["..."] and '
                                       '"open": "..."'),
            (self.grammar_generated >= 0, "grammar_generated >= 0"),
        ]
        broken = [what for ok, what in rules if not ok]
        if broken:
            raise ProtocolError(f"bad sampling parameters: need {', '.join(broken)}")

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise ProtocolError(f"logit_bias token id {bad[0]} is outside the vocabulary (size {vocab_size})")


def json_grammar(schema: dict | None = None, strict: bool = False) -> dict:
    """The wire form of a JSON constraint: any JSON object (schema None) or one that validates against `schema`."""
    if schema is None:
        return {"type": "json_object"}
    return {"type": "json_schema", "schema": schema, "strict": strict}


def grammar_ok(grammar) -> bool:
    if grammar is None:
        return True
    if not isinstance(grammar, dict):
        return False
    kind, after, opener = grammar.get("type"), grammar.get("after", []), grammar.get("open")
    gate_ok = (isinstance(after, list) and all(isinstance(a, str) and a for a in after)
               and (opener is None or (isinstance(opener, str) and opener and after)))
    return gate_ok and (kind == "json_object" or (kind == "json_schema" and isinstance(grammar.get("schema"), dict))
            or (kind == "lark" and isinstance(grammar.get("grammar"), str) and bool(grammar["grammar"])))


@dataclass
class TokenLine:
    """`{"type": "token", ...}`: one sampled token; logprob and top_logprobs ([token id, logprob], best first) only
    when the request asked for logprobs. Not frozen: a failover on the gateway rewrites `text`."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"type": "token", "token_id": self.token_id, "text": self.text}
        if self.logprob is not None:
            out["logprob"] = self.logprob
            out["top_logprobs"] = [list(t) for t in self.top_logprobs or []]
        return out

    @classmethod
    def from_json(cls, msg: dict) -> "TokenLine":
        try:
            lp, top = msg.get("logprob"), msg.get("top_logprobs")
            return cls(int(msg["token_id"]), str(msg.get("text") or ""), None if lp is None else float(lp),
                       None if top is None else [(int(t), float(v)) for t, v in top])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"malformed token line: {msg!r}") from None


@dataclass(frozen=True)
class DoneLine:
    """`{"type": "done", ...}`: the generation's last line. kv_tokens: prompt tokens whose KV arrived from prefill;
    prefix_tokens: those the node reused from an earlier request; computed_tokens: those it ran itself."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    kv_tokens: int = 0
    fallback_reason: str | None = None  # a Fallback kv_* name when the KV did not arrive
    kv_transfer_s: float = 0.0
    kv_bytes: int = 0
    kv_link_s: float = 0.0  # of kv_transfer_s, the time the KV's bytes were on the way (mid-frame)
    prefix_tokens: int = 0
    computed_tokens: int = 0
    ttft_s: float = 0.0
    kv_check: str | None = None  # with fallback_reason kv_fidelity: what the real-traffic KV check found

    def to_json(self) -> dict:
        return {"type": "done", **asdict(self)}

    @classmethod
    def from_json(cls, msg: dict) -> "DoneLine":
        """Tolerant of absent fields (an older node sends fewer); raises ProtocolError on a wrong type."""
        kinds = {"finish_reason": str, "fallback_reason": str, "kv_transfer_s": float, "kv_link_s": float,
                 "ttft_s": float, "kv_check": str}
        try:
            values = {f.name: kinds.get(f.name, int)(msg.get(f.name) or 0) for f in fields(cls)}
        except (TypeError, ValueError):
            raise ProtocolError(f"malformed done line: {msg!r}") from None
        values["finish_reason"] = str(msg.get("finish_reason") or "stop")
        values["fallback_reason"] = msg.get("fallback_reason") or None
        values["kv_check"] = msg.get("kv_check") or None
        return cls(**values)


def accepted_line(request_id: str, kv_start: int | None) -> dict:
    """The stream's first line: the node parsed the request; kv_start (only when KV was asked for) is how many
    leading prompt tokens' KV it already holds."""
    return {"type": "accepted", "request_id": request_id, **({} if kv_start is None else {"kv_start": kv_start})}


def error_line(message: str) -> dict:
    return {"type": "error", "message": message}
