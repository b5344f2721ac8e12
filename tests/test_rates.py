"""Learned rates (gateway/rates.py): priors first, convergence on a synthetic workload, and the TTFT cost model."""

from __future__ import annotations

import random

import pytest

from gateway.rates import DISAGGREGATED, LOCAL, Rate, Rates, choose_path
from kv_bridge.config import RatesConfig


def _workload(rng: random.Random, rate: float, n: int, overhead_s: float = 0.02):
    """n prefills of 10..4000 tokens at `rate` tok/s, each with a fixed overhead and +-20% noise."""
    for _ in range(n):
        tokens = rng.randint(10, 4000)
        yield tokens, (tokens / rate + overhead_s) * rng.uniform(0.8, 1.2)


def test_priors_until_observed():
    rates = Rates(RatesConfig(prefill_tokens_per_s=900, local_prefill_tokens_per_s=20, link_bytes_per_s=1e9,
                              node_priors={"spark-1": 5000, "mac-1": 200}))
    assert rates.prefill_rate("spark-0").value == 900
    assert rates.prefill_rate("spark-1").value == 5000
    assert rates.local_rate("mac-0").value == 20 and rates.local_rate("mac-1").value == 200
    assert rates.link_rate("spark-0", "mac-0").value == 1e9
    snap = rates.snapshot()
    assert snap["link_bytes_per_s"]["spark-0->mac-0"]["samples"] == 0
    assert snap["prefill_tokens_per_s"]["spark-1"]["prior"] == 5000


def test_learned_rates_converge_on_a_synthetic_workload():
    rng = random.Random(7)
    rates = Rates(RatesConfig(prefill_tokens_per_s=1000, local_prefill_tokens_per_s=16, link_bytes_per_s=1.25e9))
    truth = {"prefill": 2500.0, "local": 40.0, "link": 3.0e8}
    for tokens, seconds in _workload(rng, truth["prefill"], 60):
        rates.observe_prefill("p0", tokens, seconds)
        rates.observe_link("p0", "d0", tokens * 73728, tokens * 73728 / truth["link"] * rng.uniform(0.8, 1.2))
    for tokens, seconds in _workload(rng, truth["local"], 60):
        rates.observe_local("d0", tokens, seconds)
    assert rates.prefill_rate("p0").value == pytest.approx(truth["prefill"], rel=0.1)
    assert rates.local_rate("d0").value == pytest.approx(truth["local"], rel=0.1)
    assert rates.link_rate("p0", "d0").value == pytest.approx(truth["link"], rel=0.1)
    assert rates.prefill_rate("p0").samples == 60

    # The node slows down (a second model loaded, thermal limits): the estimate follows within a few dozen samples.
    for tokens, seconds in _workload(rng, 800.0, 40):
        rates.observe_prefill("p0", tokens, seconds)
    assert rates.prefill_rate("p0").value == pytest.approx(800.0, rel=0.1)


def test_empty_samples_are_ignored():
    r = Rate(100.0, 0.2, 2.0)
    r.observe(0, 1.0)
    r.observe(10, 0.0)
    assert r.value == 100.0 and r.samples == 0
    with pytest.raises(ValueError):
        Rate(0.0, 0.2, 1.0)


def test_cost_model_prefers_the_queue_until_it_costs_more_than_local():
    rates = Rates(RatesConfig(prefill_tokens_per_s=1000, local_prefill_tokens_per_s=16, link_bytes_per_s=1e8,
                              prior_weight_s=1.0))
    kv = 1000  # bytes per token
    idle = rates.costs("p0", "d0", 1500, kv_bytes_per_token=kv)
    assert idle.disaggregated == pytest.approx(1.5 + 1500 * kv / 1e8)
    assert idle.local == pytest.approx(1500 / 16)
    assert choose_path(idle, 1499, min_disagg_tokens=3) == DISAGGREGATED
    # 24k tokens queued ahead: 25.5 s of waiting still beats 94 s of local prefill; a queue of 100k does not.
    assert choose_path(rates.costs("p0", "d0", 1500, tokens_ahead=24_000, kv_bytes_per_token=kv), 1499, 3) \
        == DISAGGREGATED
    assert choose_path(rates.costs("p0", "d0", 1500, tokens_ahead=100_000, kv_bytes_per_token=kv), 1499, 3) == LOCAL
    # A full local batch counts against local prefill.
    short = rates.costs("p0", "d0", 20, tokens_ahead=10_000, kv_bytes_per_token=kv)
    assert short.best == LOCAL
    assert rates.costs("p0", "d0", 20, tokens_ahead=10_000, batch_tokens=400, kv_bytes_per_token=kv).best \
        == DISAGGREGATED


def test_floor_and_no_prefill_node():
    rates = Rates()
    assert choose_path(rates.costs("p0", "d0", 3000), kv_tokens=2, min_disagg_tokens=3) == LOCAL
    none = rates.costs(None, "d0", 3000)
    assert none.disaggregated is None and choose_path(none, 2999, 3) == LOCAL
