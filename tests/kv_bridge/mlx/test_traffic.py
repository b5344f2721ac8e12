"""The real-traffic KV check (kv_bridge/mlx/traffic.py) on tiny llama, qwen3_moe and gpt_oss checkpoints: layer 0
recomputed without attention equals MLX's own prefill's layer 0 (at any start); a right transfer passes over every
wire, with and without a held prefix; two blocks swapped, a slot-mapping shift, another request's block and a wrong
window cut fail, named by position; the 4-bit Mac's honest layer 0 passes."""

from __future__ import annotations

import numpy as np
import pytest

from kv_bridge.mlx import traffic
from tests.support import tiny_models
from tests.support.kv_faults import block_swapped, other_block, slot_shift
from tests.support.kv_pairs import drive, own_kv, received


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "gpt_oss"])
def tiny(request, tmp_path_factory):
    from mlx_lm import load

    kw = {"window": 512} if request.param == "gpt_oss" else {}  # every position held: layer 0 compared in full
    model, _ = load(str(tiny_models.build(request.param, tmp_path_factory.mktemp(request.param) / "m", **kw)))
    ids = [int(t) for t in np.random.default_rng(2).integers(3, 200, 160)]
    return model, ids, own_kv(model, ids)


def test_layer0_without_attention_is_mlxs_own_at_any_start(tiny):
    model, ids, (keys, values) = tiny
    k, v = drive(traffic.layer0_kv(model, ids, 0, piece=48))  # several pieces, as on the MLX thread
    assert np.abs(k - keys[0]).max() < 1e-4 and np.abs(v - values[0]).max() < 1e-4
    k, _ = drive(traffic.layer0_kv(model, ids[40:], 40))  # RoPE at the absolute position
    assert np.abs(k - keys[0][:, 40:]).max() < 1e-4


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "float8_e4m3"])
def test_a_right_transfer_passes_whole_and_after_a_held_prefix(tiny, wire):
    model, ids, (keys, values) = tiny
    out = drive(traffic.check(model, ids, received(keys, values, wire=wire), wire, "full"))
    assert out["ok"] and out["finding"] is None and out["tokens"] == len(ids)
    tail = received(keys[:, :, 64:], values[:, :, 64:], start=64, wire=wire)
    assert drive(traffic.check(model, ids, tail, wire, "full"))["ok"]


@pytest.mark.parametrize("fault", ["two blocks swapped", "slot mapping shifted", "another request's block"])
def test_a_misplaced_block_fails_and_is_named(tiny, fault):
    model, ids, (keys, values) = tiny
    other = own_kv(model, [int(t) for t in np.random.default_rng(9).integers(3, 200, len(ids))])
    layers = [{"k": keys[i], "v": values[i]} for i in range(keys.shape[0])]
    bad = {"two blocks swapped": lambda: block_swapped(layers, block=16, a=2, b=5),
           "slot mapping shifted": lambda: slot_shift(layers, first=96),
           "another request's block": lambda: other_block(
               layers, other=[{"k": other[0][i], "v": other[1][i]} for i in range(keys.shape[0])], block=16, at=3),
           }[fault]()
    kv = received(np.stack([r["k"] for r in bad]), np.stack([r["v"] for r in bad]), wire="float8_e4m3")
    out = drive(traffic.check(model, ids, kv, "float8_e4m3", "full"))
    assert not out["ok"], out
    f = out["finding"]
    assert f["value"] > f["tolerance"] and f["positions"] >= 8, f
    where = {"two blocks swapped": range(32, 96), "slot mapping shifted": range(96, 160),
             "another request's block": range(48, 64)}[fault]
    assert f["position"] in where and "position" in traffic.describe(f)


def test_only_the_positions_that_arrived_are_judged(tiny):
    """A sliding layer 0 sends only its window: the positions before it (zeros in the buffer) are not judged."""
    model, ids, (keys, values) = tiny
    k, v = keys.copy(), values.copy()
    k[0, :, :100] = v[0, :, :100] = 0
    first = np.zeros(keys.shape[0], int)
    first[0] = 100
    assert drive(traffic.check(model, ids, received(k, v, first=first), "float32", "full"))["ok"]
    first[0] = 90  # the window cut 10 positions too early: zeros where KV should be
    assert not drive(traffic.check(model, ids, received(k, v, first=first), "float32", "full"))["ok"]


def test_the_4bit_macs_honest_layer0_passes_a_swap_still_fails(llama_q4):
    full, q4 = llama_q4.full, llama_q4.q4
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 200, 160)]
    keys, values = own_kv(full, ids)  # the prefill side's full weights
    assert drive(traffic.check(q4, ids, received(keys, values, wire="float8_e4m3"), "float8_e4m3", "4"))["ok"]
    layers = [{"k": keys[i], "v": values[i]} for i in range(keys.shape[0])]
    bad = block_swapped(layers, block=16, a=1, b=7)
    kv = received(np.stack([r["k"] for r in bad]), np.stack([r["v"] for r in bad]), wire="float8_e4m3")
    assert not drive(traffic.check(q4, ids, kv, "float8_e4m3", "4"))["ok"]
