"""Speculative decoding's parts that need no decode loop: the accept rule's distribution over real SmolLM2 logits
(fixed seed), prompt lookup's index, the controller (per source and match length, at a prior or measured cost)
turning drafting down, off and back on, the config's checks, and the node's /metrics for it."""

from __future__ import annotations

import random

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from backends.decode.speculative.drafters import PromptLookup
from backends.node_metrics import DecodeMetrics
from backends.decode.speculative.control import Proposal, SpecController, expected_tokens, outcome, speedup
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
    assert pl.draft(2) == [4, 9] and pl.match_len == 3
    seq.extend([7, 7])  # no earlier [3, 7, 7] or [7, 7]
    assert pl.draft(3) == [] and pl.match_len == 0
    seq.extend([1, 2])  # [7, 1, 2] unseen; [1, 2] last seen at 5 -> 3, 7, 7
    assert pl.draft(3) == [3, 7, 7]
    quote = [5, 6, 7, 8, 1, 2, 3, 4, 9, 0]  # a 2-gram that ends a 7-token repeat matches 7 long, not 3
    pl = PromptLookup(quote + [5, 6, 7, 8, 1, 2, 3], 2, 3)
    assert pl.draft(2) == [4, 9] and pl.match_len == 7 and pl.name == "prompt_lookup"


def test_expected_tokens_and_speedup():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert speedup(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)
    assert speedup(0.9, 4, 1.0) < 1.0  # a verify forward costing k+1 plain steps never pays (mlx-cpu on netlib BLAS)


def best_fixed(alpha: float, cfg: SpeculativeConfig) -> float:
    """The expected speedup of the best fixed k (k = 0: 1.0) at the config's cost."""
    return max([1.0] + [speedup(alpha, k, cfg.verify_cost) for k in range(1, cfg.num_draft + 1)])


def step(ctl: SpecController, alpha: float, rng: random.Random, match_len: int = 8, limit: int = 16,
         name: str = "s") -> int:
    """One step of a source that always proposes `limit` tokens matched `match_len` long, each kept with probability
    alpha (i.i.d.), as the runner drives the controller; returns the drafted count (0: a plain step)."""
    p = Proposal(name, [1] * limit, match_len)
    choice = ctl.choose([p], depth=1000, limit=limit)
    k = choice[1] if choice else 0
    a = 0
    while a < max(k, 1) and rng.random() < alpha:
        a += 1
    emitted = [1] * a + [2] * (a < max(k, 1))  # the target's tokens: kept ones, then another
    if k:
        ctl.verified("s", k, *ctl.observe(p, emitted, k))
    else:
        ctl.observe(p, emitted[:1])  # a plain step still scores the proposal's first token
        ctl.plain()
    return k


def _simulate(ctl: SpecController, alpha: float, steps: int, rng: random.Random, **kw) -> tuple[float, float, float]:
    """(tokens, cost in plain steps, verify steps) over `steps` steps at i.i.d. acceptance alpha."""
    tokens = cost = on = 0.0
    for _ in range(steps):
        before = ctl.stats.accepted
        k = step(ctl, alpha, rng, **kw)
        tokens, cost, on = tokens + 1 + ctl.stats.accepted - before, cost + 1 + k * ctl.cfg.verify_cost, on + (k > 0)
    return tokens, cost, on


COSTS = (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 0.95)
ALPHAS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


@pytest.mark.parametrize("cost", COSTS)
def test_controller_settles_near_the_best_k(cost):
    """Over a grid of true alpha (i.i.d. per token) and verify costs (the prior: nothing measured), after 1,000 steps
    to settle, the next 2,000 decode within 10% of the best fixed k's expected speedup (k = 0 included), and
    drafting is on wherever some k >= 1 pays clear of the hysteresis band."""
    for alpha in ALPHAS:
        cfg = SpeculativeConfig(method="prompt_lookup", num_draft=6, verify_cost=cost)
        best = best_fixed(alpha, cfg)
        for seed in range(3):
            ctl, rng = SpecController(cfg), random.Random(seed)
            _simulate(ctl, alpha, 1000, rng, limit=6)
            tokens, spent, on = _simulate(ctl, alpha, 2000, rng, limit=6)
            assert tokens / spent >= 0.9 * best, (alpha, cost, seed, tokens / spent, best)
            if best > 1 + cfg.min_gain + 2 * cfg.hysteresis:
                assert on / 2000 >= 0.95, (alpha, cost, seed, on)


def test_acceptance_is_kept_per_match_length():
    """Short matches that are chance (alpha 0.1) and long ones that are quotes (alpha 0.9), interleaved: the short
    ones stop drafting, the long ones keep drafting at a long k."""
    cfg = SpeculativeConfig(method="prompt_lookup", num_draft=3, verify_cost=0.2)
    ctl, rng = SpecController(cfg), random.Random(2)
    short = long_ = 0
    for i in range(3000):
        long_match = i % 3 == 0
        k = step(ctl, 0.9 if long_match else 0.1, rng, match_len=20 if long_match else 2, limit=3)
        if i >= 1000:
            short, long_ = short + (k > 0 and not long_match), long_ + (k == 3 and long_match)
    assert ctl.alpha("s", 2) < 0.2 < 0.8 < ctl.alpha("s", 20)
    assert long_ >= 0.95 * 667 and short <= 0.05 * 1333, (long_, short)


def test_spurious_first_matches_do_not_switch_off_the_rest():
    """A scripted source: its first 40 proposals are spurious 2-token matches (all refused), then the text quotes
    its prompt (20-token matches, alpha 0.9). Drafting comes back within a few dozen tokens of the quote starting,
    and a fresh generation with the same controller drafts its quotes from the start."""
    cfg = SpeculativeConfig(method="prompt_lookup", num_draft=3, verify_cost=0.3)
    ctl, rng = SpecController(cfg), random.Random(5)
    trace = []
    for _ in range(40):
        trace.append(step(ctl, 0.0, rng, match_len=2, limit=3))
    assert 0 in trace[-10:]  # the short matches stopped paying
    back = next(i for i in range(400) if step(ctl, 0.9, rng, match_len=20, limit=3) > 0)
    assert back <= 32, back
    ctl.new_generation()
    assert step(ctl, 0.9, rng, match_len=20, limit=3) == 3


def test_off_still_learns_from_plain_steps():
    """Off (short matches refused), plain steps score each proposal's first token against the emitted one: when
    the same bucket starts being kept, drafting comes back without waiting for a probe."""
    cfg = SpeculativeConfig(method="prompt_lookup", num_draft=3, verify_cost=0.3, probe_every=10_000)
    ctl, rng = SpecController(cfg), random.Random(1)
    for _ in range(60):
        step(ctl, 0.0, rng, match_len=2, limit=3)
    ctl._since_probe = 0  # no probe due: only the free scoring can bring it back
    assert next(i for i in range(300) if step(ctl, 0.95, rng, match_len=2, limit=3)) < 80


def test_probes_draft_the_smallest_k_that_pays_and_count():
    cfg = SpeculativeConfig(method="prompt_lookup", num_draft=4, probe_every=3, verify_cost=0.6)
    ctl = SpecController(cfg)
    assert ctl.probe_len(1000) == 1
    assert SpecController(cfg.model_copy(update={"verify_cost": 0.93})).probe_len(1000) == 3  # 2/1.93 < 1.05
    never = SpecController(cfg.model_copy(update={"verify_cost": 1.0}))
    assert never.probe_len(1000) == 1  # nothing pays at the prior: probe once in a while to measure the real cost
    for _ in range(8):
        never.meter.add(1, 1000, 1.0)
        never.meter.add(2, 1000, 2.0)
    assert never.probe_len(1000) == 0  # measured: a drafted token costs a whole step, never probe
    never._since_probe = 10 ** 6
    assert not never.would_verify([Proposal("s", [1], 2)], 1000, 4)  # so plain steps stay pipelined
    p = Proposal("s", [1, 2, 3, 4], 2)
    for _ in range(30):
        if ctl.choose([p], 1000, 4):
            ctl.verified("s", 1, *ctl.observe(p, [9]))
        else:
            ctl.plain()
    assert ctl.stats.probes >= 5 and ctl.stats.drafted == ctl.stats.probes  # each probe drafted one token
    assert ctl.choose([], 1000, 4) is None and ctl.choose([Proposal("s", [], 0)], 1000, 4) is None


def test_a_probe_goes_to_the_least_observed_arm():
    """A costly source (a learned head) is scored only when it drafted; a lookup every step. When nothing pays and a
    probe is due, the probe verifies the head's proposal, not the lookup's better-trusted long match, so the head's
    arm learns (it stayed at its prior before: the controller never chose a head on the class replay)."""
    cfg = SpeculativeConfig(method=["prompt_lookup", "eagle3"], draft_path="x", num_draft=3, probe_every=4,
                            verify_cost=1.0)
    ctl = SpecController(cfg)
    lookup, head = Proposal("prompt_lookup", [7, 8, 9], 4), Proposal("eagle3", [7], 0, 0.1)
    for _ in range(40):  # the lookup's arm: observed on every plain step, mostly kept (nothing pays at cost 1.0)
        ctl.observe(lookup, [7, 8, 9])
    assert ctl.alpha("prompt_lookup", 4) > 0.9 > ctl.alpha("eagle3", 0)  # by alpha alone the probe was the lookup's
    ctl._since_probe = cfg.probe_every
    assert ctl.choose([lookup, head], 1000, 3) == (1, 1) and ctl.stats.probes == 1
    ctl.verified("eagle3", 1, *ctl.observe(head, [7, 5], 1))
    assert ctl.seen(head) == 1.0


def test_measured_cost_replaces_the_prior():
    """At a prior of 0.8 a 0.6 acceptance never pays; once the node has timed cheap verify steps (8 of each size)
    it drafts, and at the fused cap's limit."""
    cfg = SpeculativeConfig(method="prompt_lookup", num_draft=4, verify_cost=0.8, cost_samples=8)
    ctl, rng = SpecController(cfg), random.Random(4)
    _simulate(ctl, 0.6, 300, rng, limit=3)
    assert ctl.k == 0
    for rows in (1, 2, 3, 4):
        for _ in range(8):
            ctl.meter.add(rows, 1000, 0.1 * (1 + 0.05 * (rows - 1)))
    assert ctl.meter.ratio(3, 1000) == pytest.approx(1.15)
    _, _, on = _simulate(ctl, 0.6, 300, rng, limit=3)
    assert on >= 250 and ctl.k <= 3


def test_hysteresis_keeps_it_on_through_a_short_bad_run():
    cfg = SpeculativeConfig(method="prompt_lookup", num_draft=4, verify_cost=0.2)
    ctl, rng = SpecController(cfg), random.Random(3)
    _simulate(ctl, 0.8, 300, rng)
    assert ctl.k > 0
    for _ in range(3):  # three verify steps that keep nothing
        step(ctl, 0.0, rng)
    assert step(ctl, 0.8, rng) > 0


def test_fixed_draft_length_when_not_adaptive():
    ctl = SpecController(SpeculativeConfig(method="prompt_lookup", num_draft=5, adaptive=False))
    rng = random.Random(0)
    assert all(step(ctl, 0.0, rng, limit=8) == 5 for _ in range(10))
    assert ctl.choose([Proposal("s", [1, 2], 3)], 1000, 8) == (0, 2)  # never more than proposed


def test_config_checks():
    assert ModelRoute(id="m", path="p", decode=["d"]).speculative.sources == ()
    assert SpeculativeConfig(method=["prompt_lookup", "suffix"]).sources == ("prompt_lookup", "suffix")
    assert SpeculativeConfig(method="auto").sources == ("auto",)
    for bad in (["off", "prompt_lookup"], [], ["auto", "draft"], ["prompt_lookup", "prompt_lookup"]):
        with pytest.raises(ValidationError, match="speculative.method"):
            SpeculativeConfig(method=bad)
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
    p = Proposal("prompt_lookup", [1, 2, 3, 4], 3)
    assert on.choose([p], 1000, 4) == (0, 4)
    on.verified("prompt_lookup", 4, *on.observe(p, [1, 2, 3, 9], 4))
    on.plain()
    on.stats.ran("speculative")
    for _ in range(8):
        on.meter.add(1, 1000, 0.1)
        on.meter.add(5, 1000, 0.14)
    svc = type("S", (), {"models": {"a": _Model(on), "b": _Model(SpecController(SpeculativeConfig()))},
                         "running": 0, "receiver": type("R", (), {"transfers": {}, "inflight_bytes": 0})()})()
    text = generate_latest(DecodeMetrics(svc).registry).decode()
    assert sample_value(text, "disagg_decode_spec_drafted_tokens_total", model="a") == 4
    assert sample_value(text, "disagg_decode_spec_accepted_tokens_total", model="a") == 3
    assert sample_value(text, "disagg_decode_spec_steps_total", model="a", kind="verify") == 1
    assert sample_value(text, "disagg_decode_spec_steps_total", model="a", kind="plain") == 1
    assert sample_value(text, "disagg_decode_spec_generations_total", model="a", path="speculative") == 1
    assert sample_value(text, "disagg_decode_spec_num_draft", model="a") == 0  # the last step was plain
    assert sample_value(text, "disagg_decode_spec_acceptance", model="a") == pytest.approx(4 / 6)  # (1+3)/(2+3+1)
    # the 3-5 bucket: prior 0.55 x 2 pseudo-trials, 3 kept, 1 refused
    assert sample_value(text, "disagg_decode_spec_source_acceptance", model="a", source="prompt_lookup",
                        bucket="3-5") == pytest.approx((1.1 + 3) / (2 + 4))
    assert sample_value(text, "disagg_decode_spec_source_tokens_total", model="a", source="prompt_lookup",
                        kind="accepted") == 3
    assert sample_value(text, "disagg_decode_spec_step_seconds", model="a", rows="5", depth="0-2k") == 0.14
    assert sample_value(text, "disagg_decode_spec_verify_cost", model="a", k="4", depth="0-2k") == pytest.approx(0.1)
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


def test_two_generations_choice_follows_the_measured_step_times():
    """share(2) weighs wall times only. bench_spec_control's smoke case: drafts kept at a cheap prior cost (a
    modelled ~2.5x), a batch step of two timed 16 times at 0.1 s, a few lone 1-row steps at 0.05 s and no batch of
    one: the path unmeasured, the batch; the path measured at 12.5 tokens/s against the batch's 20, the batch; at
    30 tokens/s, per row."""
    cfg = SpeculativeConfig(method="prompt_lookup", num_draft=3, verify_cost=0.06, cost_samples=8)
    ctl, rng = SpecController(cfg), random.Random(7)
    assert ctl.share(1) and not ctl.share(2)
    _simulate(ctl, 0.9, 200, rng, limit=3, match_len=20)
    for _ in range(2):
        ctl.meter.add(1, 1000, 0.05)
    for _ in range(16):
        ctl.meter.add_batch(2, 0.1)
    assert not ctl.share(2)
    for _ in range(64):
        ctl.meter.add_path(1, 0.08)
    assert not ctl.share(2)
    for _ in range(256):
        ctl.meter.add_path(3, 0.1)
    assert ctl.share(2)
    assert not ctl.share(3)  # nothing measured for three: the batch
