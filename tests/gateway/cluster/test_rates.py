"""Learned rates (gateway/cluster/rates.py): priors first, convergence on a synthetic workload, and the TTFT cost
model."""

from __future__ import annotations

import random

import pytest

from gateway.cluster.rates import DISAGGREGATED, INGEST_TOKENS_PER_S, LOCAL, Rate, Rates, choose_path
from kv_bridge.config.gateway import RatesConfig


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
    # The transfer (0.015 s) runs under the prefill; the decode node's ingest at its prior follows it.
    assert idle.disaggregated == pytest.approx(1.5 + 1500 / INGEST_TOKENS_PER_S)
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


def test_local_prefill_is_charged_the_stall_it_imposes_on_the_decode_batch():
    """The 64th of a burst of 1.5k-token prompts: 63 prompts ahead at the prefill node's 620 tok/s make 155 s of
    waiting against 94 s of local prefill, so on its own TTFT the request would go local. But the decode node
    steps nothing else while it prefills, and 61 requests bound for it are queued for admission: the share of them
    whose KV lands within those 94 s (93.75 * 620 / 94500 = 0.615) would each wait 47 s on average."""
    rates = Rates(RatesConfig(prefill_tokens_per_s=620, local_prefill_tokens_per_s=16, link_bytes_per_s=1e9,
                              prior_weight_s=1.0))
    ahead = 63 * 1500
    alone = rates.costs("p0", "d0", 1500, tokens_ahead=ahead)
    assert alone.stall == 0 and alone.best == LOCAL
    burst = rates.costs("p0", "d0", 1500, tokens_ahead=ahead, others=2, arriving=61)
    t = 1500 / 16
    assert burst.stall == pytest.approx(t * (2 + 61 * (t * 620 / ahead) / 2))
    assert burst.best == DISAGGREGATED
    # Arrivals whose KV lands only after the local prefill is done are not held up by it: a queue of 1M tokens.
    far = rates.costs("p0", "d0", 1500, tokens_ahead=1_000_000, arriving=1)
    assert far.stall == pytest.approx(t * (t * 620 / 1_000_000) / 2) and far.best == LOCAL
    # A short prompt mid-burst stalls the batch for 2 s only: local still beats 39 s in the prefill queue.
    short = rates.costs("p0", "d0", 35, tokens_ahead=24_000, others=3, arriving=13)
    assert short.stall < 10 and short.best == LOCAL


def test_floor_and_no_prefill_node():
    rates = Rates()
    assert choose_path(rates.costs("p0", "d0", 3000), kv_tokens=2, min_disagg_tokens=3) == LOCAL
    none = rates.costs(None, "d0", 3000)
    assert none.disaggregated is None and choose_path(none, 2999, 3) == LOCAL


def test_transfer_overlaps_the_prefill_and_the_ingest_follows_it():
    """What `make site` showed (docs/site.md): a 3.7k-token prompt's KV lands as the prefill ends, and the decode
    node's first token comes ~0.9 s later. The prediction takes the slower of prefill and link, plus the queue and
    the ingest learned per (decode node, model)."""
    rates = Rates(RatesConfig(prefill_tokens_per_s=1000, link_bytes_per_s=1e7, prior_weight_s=0.01))
    fast_link = rates.disaggregated_ttft("p0", "d0", 3000, 0, kv_bytes_per_token=1000, model="m")
    assert fast_link == pytest.approx(3.0 + 3000 / INGEST_TOKENS_PER_S)  # not 3 s + 0.3 s of link
    slow_link = rates.disaggregated_ttft("p0", "d0", 3000, 0, kv_bytes_per_token=20_000, model="m")
    assert slow_link == pytest.approx(6.0 + 3000 / INGEST_TOKENS_PER_S)  # the link is the bottleneck
    queued = rates.disaggregated_ttft("p0", "d0", 3000, 2000, kv_bytes_per_token=1000, model="m")
    assert queued == pytest.approx(fast_link + 2.0)
    for _ in range(20):
        rates.observe_ingest("d0", 3700, 0.9, model="m")
    assert rates.ingest_rate("d0", "m").value == pytest.approx(3700 / 0.9, rel=0.01)
    assert rates.ingest_rate("d0", "other").value == INGEST_TOKENS_PER_S  # per model, as the local rate
    learned = rates.disaggregated_ttft("p0", "d0", 3700, 0, kv_bytes_per_token=1000, model="m")
    assert learned == pytest.approx(3.7 + 0.9, rel=0.01)
    assert rates.snapshot()["ingest_tokens_per_s"]["d0/m"]["samples"] == 20
