"""The protocol's Sampling parsed on a decode node, mlx-lm's sampler and logits processors built from them, per-token
logprobs, and stop-string matching over streamed text.

`make_sampling` and `token_logprobs` touch MLX: call them on the model's MLX thread only.
"""

from __future__ import annotations

from backends.common import bad_request
from kv_bridge.protocol import ProtocolError, Sampling
from kv_bridge.stops import StopMatcher  # noqa: F401 (re-exported: the decode node imports it from here)

PENALTY_CONTEXT = 20  # mlx-lm's default window for repetition/presence/frequency penalties
MIN_LOGPROB = -9999.0  # what a -inf logprob is reported as (JSON has no infinity), as vLLM does


def parse_sampling(body: dict, vocab_size: int | None = None) -> Sampling:
    """The protocol's Sampling from a /v1/generate body, its logit_bias ids checked against `vocab_size` when given;
    raises a 400 NodeError on a bad value."""
    try:
        s = Sampling.from_json(body)
        if vocab_size is not None:
            s.check_vocab(vocab_size)
    except ProtocolError as e:
        raise bad_request(str(e)) from None
    return s


def make_sampling(gen: Sampling, history: list[int], vocab_size: int, grammar=None):
    """(sampler, logits_processors) for mlx-lm's stream_generate or BatchGenerator. `history`: prompt tokens the
    generator will not see (their KV came from prefill), so penalties look at the same window on every path; pass []
    to BatchGenerator, which takes them as all_tokens. A seeded sampler has its own key. `grammar`: the request's
    GrammarProcessor, applied last (after penalties and bias) so nothing can re-allow a masked token. MLX thread only."""
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
    if grammar is not None:
        processors = [*processors, grammar]
    return sampler, processors


def _seeded_sampler(gen: Sampling, top_k: int):
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
