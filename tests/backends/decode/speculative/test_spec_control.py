"""Speculative decoding's parts that need no decode loop: the accept rule's distribution over real SmolLM2 logits
(fixed seed), prompt lookup's index, the controller turning drafting down, off and back on, the config's checks,
and the node's /metrics for it."""

from __future__ import annotations

import random

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from backends.decode.speculative.drafters import PromptLookup
from backends.node_metrics import DecodeMetrics
from backends.decode.speculative.control import (SpecController, best_draft, best_k, expected_tokens, outcome,
                                                  probe_len, speedup)
from backends.decode.speculative.step import accept_drafts
from tests.support.fakes import sample_value
from kv_bridge.config.models import ModelRoute
from kv_bridge.config.speculative import SpeculativeConfig
from kv_bridge.protocol import Sampling


def test_accept_rule_keeps_the_target_distribution(mlx_ref):
    """The accept rule over real verify rows, sampled 4000 times (fixed seed): a drafted token is kept as often as
    the target samples it, and when refused the emitted token follows the target with that token removed."""
    import mlx.core as mx
    import numpy as np
    from backends.decode.sampling import make_sampling

    model, tok = mlx_ref
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                  add_generation_prompt=True)
    logits = model(mx.array([ids]))[0, -2:]  # rows for [y, d], d the prompt's real last token
    p0 = np.array(mx.softmax(logits[0].astype(mx.float32)))
    d = int(np.argsort(p0)[-2])  # the second likeliest token: kept and refused alike, often
    sampler, _ = make_sampling(Sampling.from_json({"temperature": 1.0}), [], logits.shape[-1])
    mx.random.seed(0)
    firsts, kept, n = [], 0, 4000

    def pick(row):
        t = int(sampler(row - mx.logsumexp(row, axis=-1, keepdims=True)).item())
        emitted.append(t)
        return t, False
    for _ in range(n):
        emitted = []
        k = accept_drafts(logits, [d], pick)
        assert len(emitted) == k + 1 and (k == 1) == (emitted[0] == d)
        kept += k
        firsts.append(emitted[0])
    sd = (p0[d] * (1 - p0[d]) / n) ** 0.5
    assert abs(kept / n - p0[d]) < 4 * sd
    # Refused: the emitted token's distribution is p0 without d; chi-square over the likeliest tokens + the rest.
    refused = np.array([t for t in firsts if t != d])
    q = p0.copy()
    q[d] = 0
    q /= q.sum()
    top = [t for t in np.argsort(q)[::-1][:8] if q[t] * len(refused) >= 10]
    observed = [np.sum(refused == t) for t in top]
    expected = [q[t] * len(refused) for t in top]
    observed.append(len(refused) - sum(observed))
    expected.append(len(refused) - sum(expected))
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert chi2 < 26.1, (chi2, observed, expected)  # p = 0.001 at <= 8 degrees of freedom


def test_prompt_lookup_index():
    seq = [1, 2, 3, 4, 9, 1, 2, 3]
    pl = PromptLookup(seq, 2, 3)
    assert pl.draft(2) == [4, 9]
    seq.extend([7, 7])  # no earlier [3, 7, 7] or [7, 7]
    assert pl.draft(3) == []
    seq.extend([1, 2])  # [7, 1, 2] unseen; [1, 2] last seen at 5 -> 3, 7, 7
    assert pl.draft(3) == [3, 7, 7]


def test_expected_tokens_and_speedup():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert speedup(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)
    assert speedup(0.9, 4, 1.0) < 1.0  # a verify forward costing k+1 plain steps never pays (mlx-cpu on netlib BLAS)


def test_best_draft_follows_acceptance_and_cost():
    mac = SpeculativeConfig(method="prompt_lookup", num_draft=6, verify_cost=0.1)
    assert best_draft(0.9, mac) == 6
    assert 0 < best_draft(0.4, mac) < best_draft(0.7, mac)
    assert best_draft(0.05, mac) == 0
    assert best_draft(0.9, mac.model_copy(update={"verify_cost": 1.0})) == 0


def _simulate(ctl: SpecController, alpha: float, steps: int, rng: random.Random) -> tuple[float, float, float]:
    """Drive the controller with i.i.d. per-token acceptance alpha: (tokens, cost in plain steps, on-steps)."""
    tokens = cost = on = 0.0
    for _ in range(steps):
        k = ctl.draft_len()
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        ctl.record(k, a)
        tokens, cost, on = tokens + a + 1, cost + 1 + k * ctl.cfg.verify_cost, on + (k > 0)
    return tokens, cost, on


COSTS = (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 0.95)
ALPHAS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


@pytest.mark.parametrize("cost", COSTS)
def test_controller_settles_near_the_best_k(cost):
    """Over a grid of true alpha (i.i.d. per token) and verify costs, after 1,000 steps to settle, the next 2,000
    decode within 10% of the best fixed k's expected speedup (k = 0 included), and drafting is on wherever some
    k >= 1 pays clear of the hysteresis band (its expected speedup above 1 + min_gain + 2 * hysteresis)."""
    for alpha in ALPHAS:
        cfg = SpeculativeConfig(method="prompt_lookup", num_draft=6, verify_cost=cost)
        best = max(1.0, best_k(alpha, cfg)[1])
        for seed in range(3):
            ctl, rng = SpecController(cfg), random.Random(seed)
            _simulate(ctl, alpha, 1000, rng)
            tokens, spent, on = _simulate(ctl, alpha, 2000, rng)
            assert tokens / spent >= 0.9 * best, (alpha, cost, seed, tokens / spent, best)
            if best > 1 + cfg.min_gain + 2 * cfg.hysteresis:
                assert on / 2000 >= 0.95, (alpha, cost, seed, on)


def test_alpha_is_per_token_acceptance_not_accepted_over_drafted():
    """A true alpha of 0.7 at k = 4 keeps 0.7 + 0.49 + 0.34 + 0.24 = 1.77 of 4 drafted tokens (0.44 of them): the
    estimate is 0.7, and at the documented Qwen3-Coder cost (0.6) k = 1 pays from alpha ~0.66, so it is on."""
    cfg = SpeculativeConfig(method="prompt_lookup", num_draft=4, adaptive=False, verify_cost=0.6)
    ctl, rng = SpecController(cfg), random.Random(1)
    _simulate(ctl, 0.7, 3000, rng)
    assert ctl.rate == pytest.approx(0.7, abs=0.06)
    assert ctl.stats.accepted / ctl.stats.drafted == pytest.approx(0.44, abs=0.05)
    adaptive = SpecController(cfg.model_copy(update={"adaptive": True}))
    _simulate(adaptive, 0.8, 1000, rng)
    assert adaptive.draft_len() >= 1  # the old controller stayed at 0 fed alpha = 0.8


def test_outcome_counts_a_rejection_only_where_one_was_seen():
    assert outcome([5, 6, 7], [5, 6, 9]) == (2, 1)
    assert outcome([5, 6, 7], [5, 6, 7, 8]) == (3, 0)
    assert outcome([5, 6, 7], [5]) == (1, 0)  # the step finished on a kept token (EOS, max_tokens): censored
    assert outcome([5], [4]) == (0, 1)


def test_probes_draft_the_smallest_k_that_pays_and_turn_it_back_on():
    """Off after nothing is kept; each probe drafts the smallest k that pays at all (1 at a low cost, more where one
    drafted token cannot cover its cost); a text that starts repeating its prompt turns it back on."""
    cfg = SpeculativeConfig(method="prompt_lookup", num_draft=4, probe_every=3, verify_cost=0.6)
    assert probe_len(cfg) == 1
    assert probe_len(cfg.model_copy(update={"verify_cost": 0.93})) == 3  # 2/1.93 < 1.05, 4/2.86 > 1.05
    assert probe_len(cfg.model_copy(update={"verify_cost": 1.0})) == 0  # nothing ever pays: no probes
    ctl = SpecController(cfg)
    assert ctl.draft_len() == 1  # alpha 0.5 does not pay at this cost: it starts by probing
    offs = 0
    while offs < 40:
        k = ctl.draft_len()
        ctl.record(k, 0)
        offs += 1
    assert ctl.k == 0
    probes = []
    for _ in range(200):
        k = ctl.draft_len()
        probes.append(k)
        ctl.record(k, k)  # everything drafted is kept
        if ctl.k:
            break
    assert ctl.k > 0 and set(probes) <= {0, 1} and 1 in probes
    s = ctl.stats
    assert s.verify_steps + s.plain_steps == offs + len(probes)


def test_hysteresis_keeps_it_on_through_a_short_bad_run():
    cfg = SpeculativeConfig(method="prompt_lookup", num_draft=4, verify_cost=0.2)
    ctl, rng = SpecController(cfg), random.Random(3)
    _simulate(ctl, 0.8, 300, rng)
    k = ctl.k
    assert k > 0
    for _ in range(3):  # three verify steps that keep nothing
        ctl.record(ctl.draft_len(), 0)
    assert ctl.k > 0


def test_fixed_draft_length_when_not_adaptive():
    ctl = SpecController(SpeculativeConfig(method="prompt_lookup", num_draft=5, adaptive=False))
    for _ in range(10):
        ctl.record(5, 0)
    assert ctl.draft_len() == 5


def test_config_checks():
    assert ModelRoute(id="m", path="p", decode=["d"]).speculative.method == "off"
    with pytest.raises(ValidationError, match="draft_path"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValidationError, match="ngram_min"):
        SpeculativeConfig(method="prompt_lookup", ngram_min=5, ngram_max=3)
    r = ModelRoute(id="m", path="p", decode=["d"], speculative={"method": "prompt_lookup", "num_draft": 6})
    assert r.speculative.num_draft == 6


class _Model:
    """What the decode metrics read from an MLXModel (backends/node_metrics.py _ModelState)."""

    def __init__(self, speculation):
        self.speculation, self.batch_size, self.cache_bytes = speculation, 1, 0
        self.prefixes = type("P", (), {"nbytes": 0})()

    def queued(self) -> int:
        return 0


def test_metrics_show_drafted_accepted_and_the_controller():
    on = SpecController(SpeculativeConfig(method="prompt_lookup", num_draft=4, adaptive=False))
    on.record(4, 3)
    on.record(0, 0)
    on.stats.ran("speculative")
    svc = type("S", (), {"models": {"a": _Model(on), "b": _Model(SpecController(SpeculativeConfig()))},
                         "running": 0, "receiver": type("R", (), {"transfers": {}, "inflight_bytes": 0})()})()
    text = generate_latest(DecodeMetrics(svc).registry).decode()
    assert sample_value(text, "disagg_decode_spec_drafted_tokens_total", model="a") == 4
    assert sample_value(text, "disagg_decode_spec_accepted_tokens_total", model="a") == 3
    assert sample_value(text, "disagg_decode_spec_steps_total", model="a", kind="verify") == 1
    assert sample_value(text, "disagg_decode_spec_steps_total", model="a", kind="plain") == 1
    assert sample_value(text, "disagg_decode_spec_generations_total", model="a", path="speculative") == 1
    assert sample_value(text, "disagg_decode_spec_num_draft", model="a") == 4
    # alpha: (prior 1 + 3 accepted) / (that + prior 1 + 1 rejection), the prior discounted by one verify step
    d = 1 - on.cfg.ewma_alpha
    assert sample_value(text, "disagg_decode_spec_acceptance", model="a") == pytest.approx((d + 3) / (2 * d + 4))
    assert sample_value(text, "disagg_decode_spec_drafted_tokens_total", model="b") is None  # off: not shown


def test_site_verify_cost_from_what_a_verify_forward_reads():
    """The KV read is shared by a verify forward's tokens: the longer the context, the cheaper each drafted token;
    experts are not (each token routes to its own), so gpt-oss (4 of 128, bigger experts) pays more than Qwen3-Coder."""
    from backends.decode.speculative.gain import SHAPES, decode_speedup, forward_cost, verify_cost

    qwen, oss = SHAPES["qwen3_moe"], SHAPES["gpt_oss"]
    assert verify_cost(qwen, 25000, 4) < verify_cost(qwen, 6000, 4) < verify_cost(qwen, 0, 4) < 1.0
    assert verify_cost(oss, 25000, 4) > verify_cost(qwen, 25000, 4)
    assert forward_cost(qwen, 0, 1) == 1.0
    assert forward_cost(qwen, 0, 5, repeat=1.0) > forward_cost(qwen, 0, 2)  # independent routing: more experts
    assert decode_speedup(qwen, 25000, 0.0, 0.5) == (0, 1.0)  # nothing kept: never pays
    assert decode_speedup(qwen, 25000, 0.9, 0.8)[1] > decode_speedup(oss, 25000, 0.9, 0.8)[1] > 1.0
