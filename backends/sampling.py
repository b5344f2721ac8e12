"""Sampling parameters a decode node accepts, mlx-lm's sampler and logits processors built from them, per-token
logprobs, and stop-string matching over streamed text.

`make_sampling` and `token_logprobs` touch MLX: call them on the model's MLX thread only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from backends.common import bad_request
from kv_bridge.stops import StopMatcher  # noqa: F401 (re-exported: the decode node imports it from here)

MAX_TOP_LOGPROBS = 20
PENALTY_CONTEXT = 20  # mlx-lm's default window for repetition/presence/frequency penalties
MIN_LOGPROB = -9999.0  # what a -inf logprob is reported as (JSON has no infinity), as vLLM does
_SEED_SPACE = 1 << 64  # mx.random.seed takes an unsigned 64-bit seed


@dataclass(frozen=True)
class GenParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # alternatives per token to report; None: no logprobs

    @classmethod
    def parse(cls, body: dict) -> "GenParams":
        """From a /v1/generate body (docs/protocol.md); raises a 400 NodeError on a bad value."""
        def num(key: str, default, kind=float):
            value = body.get(key)
            return default if value is None else kind(value)

        try:
            p = cls(max_tokens=num("max_tokens", 256, int), temperature=num("temperature", 0.0),
                    top_p=num("top_p", 1.0), seed=_seed(body.get("seed")), stop=list(body.get("stop") or []),
                    top_k=num("top_k", 0, int), min_p=num("min_p", 0.0),
                    presence_penalty=num("presence_penalty", 0.0), frequency_penalty=num("frequency_penalty", 0.0),
                    repetition_penalty=num("repetition_penalty", 1.0), logit_bias=_bias(body.get("logit_bias")),
                    logprobs=num("logprobs", None, int))
        except (TypeError, ValueError, AttributeError) as e:
            raise bad_request(f"bad sampling parameter: {e}") from None
        p._check()
        return p

    def _check(self) -> None:
        floats = (self.temperature, self.top_p, self.min_p, self.presence_penalty, self.frequency_penalty,
                  self.repetition_penalty, *self.logit_bias.values())
        if not all(math.isfinite(v) for v in floats):
            raise bad_request("sampling parameters must be finite numbers")
        rules = [
            (self.max_tokens >= 1, "max_tokens >= 1"), (self.temperature >= 0, "temperature >= 0"),
            (0 < self.top_p <= 1, "0 < top_p <= 1"), (self.top_k >= 0, "top_k >= 0"),
            (0 <= self.min_p <= 1, "0 <= min_p <= 1"),
            (abs(self.presence_penalty) <= 2 and abs(self.frequency_penalty) <= 2, "penalties in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty > 0"),
            (all(t >= 0 and abs(b) <= 100 for t, b in self.logit_bias.items()),
             "logit_bias maps token ids >= 0 to biases in [-100, 100]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS, f"logprobs in [0, {MAX_TOP_LOGPROBS}]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop is a list of non-empty strings"),
        ]
        broken = [what for ok, what in rules if not ok]
        if broken:
            raise bad_request(f"bad sampling parameters: need {', '.join(broken)}")

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise bad_request(f"logit_bias token id {bad[0]} is outside the vocabulary (size {vocab_size})")


def _seed(value) -> int | None:
    return None if value is None else int(value) % _SEED_SPACE


def _bias(value) -> dict[int, float]:
    if not value:
        return {}
    return {int(k): float(v) for k, v in value.items()}


def make_sampling(gen: GenParams, history: list[int], vocab_size: int):
    """(sampler, logits_processors) for mlx-lm's stream_generate or BatchGenerator. `history`: prompt tokens the
    generator will not see (their KV came from prefill), so penalties look at the same window on every path; pass []
    to BatchGenerator, which takes them as all_tokens. A seeded sampler has its own key. MLX thread only."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    # mlx-lm's top-k refuses k >= vocab; such a k keeps every token anyway.
    top_k = gen.top_k if gen.top_k < vocab_size else 0
    if gen.seed is not None and gen.temperature > 0:
        sampler = _seeded_sampler(gen, top_k)
    else:
        sampler = make_sampler(temp=gen.temperature, top_p=gen.top_p, min_p=gen.min_p, top_k=top_k)
    processors = make_logits_processors(
        logit_bias=gen.logit_bias or None,
        repetition_penalty=None if gen.repetition_penalty == 1.0 else gen.repetition_penalty,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=gen.presence_penalty or None, presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=gen.frequency_penalty or None, frequency_context_size=PENALTY_CONTEXT,
    )
    if processors and history:
        prefix = mx.array(history[-PENALTY_CONTEXT:])
        processors = [_with_history(p, prefix) for p in processors]
    return sampler, processors


def _seeded_sampler(gen: GenParams, top_k: int):
    """make_sampler's chain (top_p, min_p, top_k, then temperature) drawing from the request's own key.

    mlx-lm's categorical sampling draws from MLX's global generator, which every request in a batch shares, so a
    seed there would not repeat once other requests draw in between. This sampler splits its own key per token:
    a seeded request gives the same tokens alone or batched with anything.
    """
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    filters = []
    if 0 < gen.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, gen.top_p))
    if gen.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, gen.min_p))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    key = mx.random.key(gen.seed)

    def sampler(logprobs):
        nonlocal key
        key, draw = mx.random.split(key)
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * (1.0 / gen.temperature), key=draw)

    return sampler


def _with_history(processor, prefix):
    import mlx.core as mx

    return lambda tokens, logits: processor(mx.concatenate([prefix, tokens.astype(prefix.dtype)]), logits)


def token_logprobs(logprobs, token: int, k: int) -> tuple[float, list[list]]:
    """The chosen token's logprob and the k likeliest [token_id, logprob], best first, from a (vocab,) log-softmax.
    MLX thread only."""
    import mlx.core as mx

    lp = logprobs.astype(mx.float32)
    chosen = max(lp[token].item(), MIN_LOGPROB)
    if k <= 0:
        return chosen, []
    idx = mx.argpartition(-lp, kth=k - 1)[:k]
    vals = lp[idx]
    order = mx.argsort(-vals)
    return chosen, [[i, max(v, MIN_LOGPROB)] for i, v in zip(idx[order].tolist(), vals[order].tolist())]
