"""The decode node's sampling: /v1/generate body parsing and validation, and the mlx-lm sampler, logits
processors and logprobs built from it (run here on MLX's CPU backend)."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from backends.common import NodeError
from backends.decode.sampling import PENALTY_CONTEXT, make_sampling, parse_sampling, token_logprobs
from kv_bridge.protocol import Sampling

VOCAB = 64


def test_parse_every_field():
    body = {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 42, "stop": ["\n"], "top_k": 40,
            "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
            "logit_bias": {"7": -100, "9": 2.5}, "logprobs": 3}
    p = parse_sampling(body)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.top_k, p.min_p) == (5, 0.7, 0.9, 42, ["\n"], 40,
                                                                                          0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logit_bias == {7: -100.0, 9: 2.5} and p.logprobs == 3


def test_parse_defaults_and_nulls():
    keys = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs")
    for body in ({}, dict.fromkeys(keys)):
        assert parse_sampling(body) == Sampling()


def test_seed_wraps_to_unsigned_64_bits():
    assert parse_sampling({"seed": -1}).seed == 2**64 - 1
    assert parse_sampling({"seed": 2**64 + 3}).seed == 3


@pytest.mark.parametrize("patch", [
    {"top_k": -1}, {"min_p": 1.5}, {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
    {"logit_bias": {"x": 1}}, {"logit_bias": {"5": 101}}, {"logit_bias": {"-1": 1}}, {"logit_bias": [1]},
    {"logprobs": 21}, {"logprobs": -1}, {"logprobs": "many"}, {"temperature": "nan"}, {"top_p": 0},
    {"stop": [""]}, {"max_tokens": 0},
])
def test_parse_rejects(patch):
    with pytest.raises(NodeError) as e:
        parse_sampling(patch)
    assert e.value.status == 400


def test_logit_bias_outside_vocab():
    parse_sampling({"logit_bias": {str(VOCAB - 1): 1}}, VOCAB)
    with pytest.raises(NodeError):
        parse_sampling({"logit_bias": {str(VOCAB): 1}}, VOCAB)


def logits_with_max(at: int) -> "mx.array":
    x = mx.arange(VOCAB, dtype=mx.float32)[None] / VOCAB
    return x.at[:, at].add(mx.array(5.0))


def zeros() -> "mx.array":
    # A fresh array per call: mlx-lm's presence and repetition processors assign into the logits they get.
    return mx.zeros((1, VOCAB))


def apply(processors, tokens: list[int], logits):
    toks = mx.array(tokens, dtype=mx.uint32)
    for p in processors:
        logits = p(toks, logits)
    return logits


def test_logit_bias_moves_greedy_choice():
    gen = Sampling(logit_bias={3: -100.0})
    sampler, procs = make_sampling(gen, [], VOCAB)
    logits = logits_with_max(3)
    assert sampler(logits).item() == 3
    assert sampler(apply(procs, [1], logits)).item() != 3


def test_top_k_one_is_greedy_and_top_k_of_vocab_is_allowed():
    logits = logits_with_max(11)
    sampler, _ = make_sampling(Sampling(temperature=1.0, top_k=1), [], VOCAB)
    assert {sampler(logits).item() for _ in range(20)} == {11}
    sampler, _ = make_sampling(Sampling(temperature=1.0, top_k=VOCAB), [], VOCAB)  # clamped to off
    assert 0 <= sampler(logits).item() < VOCAB


def test_seeded_sampling_repeats():
    sampler, _ = make_sampling(Sampling(temperature=1.0), [], VOCAB)
    logits = mx.zeros((1, VOCAB))

    def draw(seed: int) -> list[int]:
        mx.random.seed(seed)
        return [sampler(logits).item() for _ in range(10)]

    assert draw(5) == draw(5) != draw(6)


def test_penalties_see_prefilled_history():
    """Prompt tokens whose KV came from prefill are invisible to stream_generate; the history wrapper shows them."""
    gen = Sampling(presence_penalty=1.0)
    _, procs = make_sampling(gen, [], VOCAB)
    assert apply(procs, [5], zeros())[0, 2].item() == 0.0
    _, procs = make_sampling(gen, [2], VOCAB)
    out = apply(procs, [5], zeros())
    assert out[0, 2].item() == -1.0 and out[0, 5].item() == -1.0
    _, procs = make_sampling(gen, list(range(40)), VOCAB)  # only the last PENALTY_CONTEXT tokens count
    out = apply(procs, [50], zeros())
    assert out[0, 40 - PENALTY_CONTEXT - 1].item() == 0.0 and out[0, 39].item() == -1.0


def test_repetition_and_frequency_penalties():
    _, procs = make_sampling(Sampling(repetition_penalty=2.0), [], VOCAB)
    assert apply(procs, [4], zeros() + 2.0)[0, 4].item() == 1.0
    _, procs = make_sampling(Sampling(frequency_penalty=0.5), [], VOCAB)
    assert apply(procs, [4, 4], zeros() + 2.0)[0, 4].item() == 1.0
    assert make_sampling(Sampling(), [1, 2], VOCAB)[1] == []  # nothing to apply: no processors at all


def test_token_logprobs():
    logits = mx.random.normal((VOCAB,), key=mx.random.key(0))
    lp = logits - mx.logsumexp(logits)
    chosen, top = token_logprobs(lp, 7, 5)
    assert math.isclose(chosen, lp[7].item(), rel_tol=1e-6)
    assert len(top) == 5 and top[0][0] == mx.argmax(lp).item()
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    ref = sorted(lp.tolist(), reverse=True)[:5]
    assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), b in zip(top, ref))
    assert token_logprobs(lp, 7, 0) == (chosen, [])


def test_token_logprobs_never_infinite():
    lp = mx.array([0.0] + [-float("inf")] * (VOCAB - 1))
    chosen, top = token_logprobs(lp, 3, 2)
    assert chosen == -9999.0 and top[0] == [0, 0.0] and top[1][1] == -9999.0


def test_seeded_sampler_has_its_own_key():
    """A seeded request repeats whatever its batch neighbours draw from MLX's global generator in between."""
    logits = mx.zeros((1, VOCAB))

    def draw(seed: int, neighbours: bool) -> list[int]:
        sampler, _ = make_sampling(Sampling(temperature=1.0, top_p=0.9, seed=seed), [], VOCAB)
        out = []
        for _ in range(10):
            if neighbours:
                mx.random.categorical(logits)  # another request's draw from the global generator
            out.append(sampler(logits).item())
        return out

    assert draw(5, False) == draw(5, True) != draw(6, False)
