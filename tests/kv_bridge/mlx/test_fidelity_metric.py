"""The canary's metric and rule on real mlx-lm KV of a tiny llama: honest pairs (same weights, and mlx-lm's own 4-bit
conversion, over each wire encoding) verify; each fault of the catalogue (tests/support/kv_faults.py) is caught and
named. bench/bench_fidelity.py runs the same over 50 prompts per pairing and on SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest

from kv_bridge import dtypes
from kv_bridge.mlx.fidelity_metric import judge, wire_encode
from tests.support.kv_faults import FAULTS, mlx_prefill_kv

WIRES = ("float32", "bfloat16", "float8_e4m3")


@pytest.fixture(scope="module")
def pair(llama_q4):
    """(prefill KV of two prompts, decode-side KV per weights, rope) for a tiny llama and its 4-bit conversion."""
    full, q4 = llama_q4.full, llama_q4.q4
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 3000, 96)] for _ in range(2)]
    sent = [mlx_prefill_kv(full, ids) for ids in prompts]
    return sent, {"full": mlx_prefill_kv(full, prompts[0]), "4": mlx_prefill_kv(q4, prompts[0])}, llama_q4.rope


def _wire(layers, wire):
    return [{t: wire_encode(x, wire, 32) for t, x in r.items()} for r in layers]


@pytest.mark.parametrize("weights", ["full", "4"])
@pytest.mark.parametrize("wire", WIRES)
def test_an_honest_pair_verifies_and_every_fault_is_caught_and_named(pair, weights, wire):
    sent, own, rope = pair
    honest = judge(_wire(sent[0], wire), own[weights], wire, weights, 32, rope)
    assert honest["findings"] == [], honest["findings"][:2]
    assert honest["worst"]["value"] <= honest["worst"]["tolerance"]
    for name, fault in FAULTS.items():
        got = judge(_wire(fault(sent[0], rope=rope, other=sent[1]), wire), own[weights], wire, weights, 32, rope)
        assert got["findings"], name
        w = got["worst"]
        assert w["tensor"] in ("K", "V") and 0 <= w["layer"] < len(sent[0]) and w["tolerance"] > 0, (name, w)


def test_structural_faults_are_named_by_their_rival_slot(pair):
    sent, own, rope = pair
    named = {"K/V swapped": "V head", "layer shifted by one": "layer", "RoPE positions +1": "positions +1"}
    for name, rival in named.items():
        w = judge(FAULTS[name](sent[0], rope=rope, other=sent[1]), own["4"], "float32", "4", None, rope)["worst"]
        assert w["metric"] == "placement" and rival in w["what"], (name, w)


def test_the_wire_floor_is_measured_not_assumed():
    x = np.random.default_rng(0).standard_normal((2, 40, 64)).astype(np.float32)
    x[0, 3, 5] = 1e5  # one outlier: its frame's fp8 scale pushes every other entry there to subnormals
    def rel(w, s):  # head 1 (no outlier) over positions s: what the wire does to ordinary entries
        y, x1 = wire_encode(x, w, 8)[1, s], x[1, s]
        return float(np.sqrt(((y - x1) ** 2).sum() / (x1 * x1).sum()))
    ordinary = slice(8, 40)
    assert rel("float32", ordinary) == 0 and 0 < rel("bfloat16", ordinary) < 0.01 < rel("float8_e4m3", ordinary) < 0.1
    assert rel("float8_e4m3", slice(0, 8)) > 3 * rel("float8_e4m3", ordinary)  # the outlier's frame
    scale = float(np.abs(x[:, :8]).max()) / 448  # the connector's rounding (kv_bridge/dtypes.py), bit for bit
    assert np.array_equal(wire_encode(x, "float8_e4m3", 8)[:, :8],
                          dtypes.to_float32(dtypes.e4m3_encode(x[:, :8], scale), "float8_e4m3", scale))
    with pytest.raises(ValueError, match="int8"):
        wire_encode(x, "int8")
    with pytest.raises(ValueError, match="weights"):
        judge([], [], "float32", "3")
