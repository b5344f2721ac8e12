"""A decode node serving two models learns a local prefill rate per model: the tiny model's fast local prefills
must not make the router send a large model's long prompt to local prefill (seen on `make site`: a 2.7k-token
SmolLM2 prompt went local on mac-0 at a rate learned from gpt-oss:tiny, ~3 minutes instead of ~3 s)."""

from __future__ import annotations

from gateway.cluster.rates import DISAGGREGATED, LOCAL, Rates
from kv_bridge.config.gateway import RatesConfig

SMOL, TINY = "smollm2:135m", "gpt-oss:tiny"


def rates() -> Rates:
    return Rates(RatesConfig(prefill_tokens_per_s=1000, local_prefill_tokens_per_s=16, link_bytes_per_s=3e8))


def test_one_models_local_rate_does_not_price_the_other():
    r = rates()
    for _ in range(10):
        r.observe_local("mac-0", 2000, 1.0, TINY)  # the tiny model prefills 2,000 tokens/s on the Mac
    tiny = r.costs("spark-1", "mac-0", 2700, kv_bytes_per_token=1000, model=TINY)
    smol = r.costs("spark-0", "mac-0", 2700, kv_bytes_per_token=46080, model=SMOL)
    assert tiny.best == LOCAL and smol.best == DISAGGREGATED
    assert smol.local == 2700 / 16  # still the prior: nothing was learned about SmolLM2's local prefill
    snap = r.snapshot()["local_prefill_tokens_per_s"]
    assert snap[f"mac-0/{TINY}"]["samples"] == 10 and f"mac-0/{SMOL}" in snap


def test_node_priors_still_apply_per_model():
    r = Rates(RatesConfig(local_prefill_tokens_per_s=16, node_priors={"mac-0": 400.0}))
    assert r.local_rate("mac-0", SMOL).value == 400.0 and r.local_rate("mac-1", SMOL).value == 16
