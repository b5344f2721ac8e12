"""Which canary a pair gets next (issue #50: the canary exercises the path requests take): a fresh random nonce in its
text (no vLLM prefix-cache hit on an earlier canary), the whole canary and the prefix path in turn (the prefix round
reuses the previous round's text, so the prefill node serves its start from its prefix cache and sends KV from
kv_start > 0), and first after a start one canary longer than a prefill engine step (several steps, several fp8
frames per layer), or whenever the caller asks for that long form (a pair real traffic demoted)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Round:
    tokens: int  # the canary's length (at least)
    nonce: str  # put at the start of its text
    prefix: int  # tokens the decode node holds as a reused prefix (kv_start); 0: the whole canary arrives as KV
    long: bool = False  # the start canary's multi-step form (longer than the usual canary)


class CanaryPlan:
    """Per (model, prefill node): round 0 the long start canary (when `start_tokens` is past the usual length), then
    whole and prefix rounds alternating. A configured `prefix_tokens` pins the prefix path (every round). `long`
    asks for the long start form (a fresh nonce) whatever the round."""

    def __init__(self) -> None:
        self._rounds: dict[tuple[str, str], int] = {}
        self._nonces: dict[tuple[str, str], str] = {}

    def next(self, model: str, prefill: str, want: int, start_tokens: int, prefix_tokens: int,
             long: bool = False) -> Round:
        key = (model, prefill)
        n = self._rounds.get(key, 0)
        self._rounds[key] = n + 1
        long = (long or n == 0) and start_tokens > want
        prefix_round = n % 2 == 1 and key in self._nonces and not long
        nonce = self._nonces[key] if prefix_round else uuid.uuid4().hex[:12]
        self._nonces[key] = nonce
        tokens = start_tokens if long else want
        prefix = prefix_tokens or (want // 2 if prefix_round else 0)
        return Round(tokens, nonce, prefix, long)
