"""Faults that hid in the canary's averages (issue #50), on real mlx-lm KV of a tiny llama and its 4-bit conversion:
a block fault on layers past the first (gpt-oss's layer 0 slides) is seen by the per-layer position runs; one KV
head scaled is seen per head; the pair's calibrated gain band (from honest canaries) passes honest canaries and
catches a downward scale; isolated noisy positions are not a run."""

from __future__ import annotations

import numpy as np
import pytest

from kv_bridge.mlx.fidelity_metric import gain_band, judge, position_runs, wire_encode
from tests.support import tiny_models
from tests.support.kv_faults import block_swapped, head_scaled, mlx_prefill_kv, scaled_down


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(prefill KV of 6 prompts, the 4-bit decode side's KV of them, rope) of a tiny llama."""
    from mlx_lm import load

    from backends.cli.checkpoints import convert
    from kv_bridge.mlx.fidelity import rope_shift

    work = tmp_path_factory.mktemp("llama")
    src = tiny_models.build("llama", work / "m")
    full, _ = load(str(src))
    q4, _ = load(str(convert(src, work / "q4", 4)))
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 3000, 128)] for _ in range(6)]
    return [mlx_prefill_kv(full, p) for p in prompts], [mlx_prefill_kv(q4, p) for p in prompts], rope_shift(full)


def _fp8(layers):
    return [{t: wire_encode(x, "float8_e4m3", 32) for t, x in r.items()} for r in layers]


def test_a_block_fault_past_layer_0_is_a_run_of_positions_far_above_the_layers_median(pair):
    sent, own, rope = pair
    bad = [sent[0][0]] + block_swapped(sent[0][1:], block=16, a=1, b=5)  # layer 0 right, as a sliding one can be
    got = judge(_fp8(bad), own[0], "float8_e4m3", "4", 32, rope)
    runs = [f for f in got["findings"] if f["metric"] == "position error"]
    assert runs and all(f["layer"] > 0 for f in runs), got["findings"][:3]
    assert "far above layer" in runs[0]["what"]


def test_isolated_noisy_positions_are_not_a_run():
    rng = np.random.default_rng(0)
    r = rng.standard_normal((2, 128, 64)).astype(np.float32)
    b = r + 0.05 * rng.standard_normal(r.shape).astype(np.float32)
    b[:, [7, 30, 77]] += 2 * rng.standard_normal((2, 3, 64)).astype(np.float32)  # three lone outliers
    assert position_runs(1, "k", b, r, "float32", None) is None
    b[:, 40:44] = r[:, 90:94]  # four positions holding others' KV: a run
    assert position_runs(1, "k", b, r, "float32", None)["what"].startswith("positions 40-43")


def test_one_head_scaled_is_caught_per_head(pair):
    sent, own, rope = pair
    got = judge(_fp8(head_scaled(sent[0], head=1)), own[0], "float8_e4m3", "4", 32, rope)
    (f, *_) = [f for f in got["findings"] if f["metric"] == "|gain - 1|" and f["head"] == 1]
    assert f["tensor"] == "V" and abs(f["value"] - 0.2) < 0.05, f


def test_the_pairs_calibrated_band_passes_honest_canaries_and_catches_a_downward_scale(pair):
    sent, own, rope = pair
    cal = [judge(_fp8(s), o, "float8_e4m3", "4", 32, rope) for s, o in zip(sent[:4], own[:4])]
    band = gain_band(cal)
    for s, o in zip(sent[4:], own[4:]):  # canaries the band was not measured on
        assert judge(_fp8(s), o, "float8_e4m3", "4", 32, rope, band=band)["findings"] == []
    got = judge(_fp8(scaled_down(sent[4])), own[4], "float8_e4m3", "4", 32, rope, band=band)
    assert any(f["metric"] == "|gain - 1|" and f["head"] is not None and f["tensor"] == "V"
               for f in got["findings"]), got["findings"][:3]
