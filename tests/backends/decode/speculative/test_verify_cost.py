"""The measured verify cost (backends/decode/speculative/verify_cost.py): the prior until enough samples of both
sizes, a median robust to a stalled step, per context depth with the nearest depth as a stand-in."""

from __future__ import annotations

import pytest

from backends.decode.speculative.verify_cost import DEPTH_NAMES, VerifyCost, depth_bucket


def fill(v: VerifyCost, rows: int, depth: int, seconds: float, n: int) -> None:
    for _ in range(n):
        v.add(rows, depth, seconds)


def test_prior_until_both_sizes_have_enough_samples():
    v = VerifyCost(prior_cost=0.5, min_samples=4)
    assert v.ratio(3, 10_000) == 2.5 and v.ratio(0, 10_000) == 1.0
    fill(v, 1, 10_000, 0.10, 4)
    fill(v, 4, 10_000, 0.13, 3)
    assert v.ratio(3, 10_000) == 2.5  # three of four samples: still the prior
    v.add(4, 10_000, 0.13)
    assert v.ratio(3, 10_000) == pytest.approx(1.3)
    assert v.costs() == [(3, "8k-16k", pytest.approx(0.1))]


def test_verify_steps_of_varying_k_measure_together():
    """k changes step to step: three sizes of three samples each (none at min_samples alone) fit one cost."""
    v = VerifyCost(prior_cost=0.1, min_samples=8)
    fill(v, 1, 4_000, 0.10, 8)
    for rows in (2, 3, 4):
        fill(v, rows, 4_000, 0.10 * rows, 2)
    assert v.ratio(2, 4_000) == pytest.approx(1.2)  # six verify steps: the prior
    for rows in (2, 3, 4):
        v.add(rows, 4_000, 0.10 * rows)
    assert v.ratio(2, 4_000) == pytest.approx(3.0)  # nine: each drafted token measured at a whole plain step


def test_median_shrugs_off_a_stalled_step_and_the_fit_stays_monotonic():
    v = VerifyCost(prior_cost=0.5, min_samples=4)
    fill(v, 1, 100, 0.10, 9)
    v.add(1, 100, 5.0)  # a step stalled by something else on the machine
    fill(v, 2, 100, 0.11, 5)
    assert v.ratio(1, 100) == pytest.approx(1.1)
    fill(v, 3, 100, 0.09, 5)  # 3 rows faster than one: noise, counted as no extra cost
    c = (5 * 0.1 + 5 * 0.0) / (5 * 1 + 5 * 2)  # one cost per drafted token over both sizes, by samples
    assert v.ratio(1, 100) == pytest.approx(1 + c) and v.ratio(2, 100) == pytest.approx(1 + 2 * c)
    assert v.ratio(3, 100) > v.ratio(2, 100) > v.ratio(1, 100) > 1.0  # never a longer draft for a cheaper verify


def test_depth_buckets_and_the_nearest_measured_depth():
    assert [depth_bucket(d) for d in (0, 2047, 2048, 8191, 8192, 16384, 30000)] == [0, 0, 1, 1, 2, 3, 3]
    assert len(DEPTH_NAMES) == 4
    v = VerifyCost(prior_cost=0.5, min_samples=2)
    fill(v, 1, 20_000, 0.2, 2)
    fill(v, 2, 20_000, 0.24, 2)
    assert v.ratio(1, 1_000) == pytest.approx(1.2)  # nothing measured at 1k: the nearest depth that has both
    fill(v, 1, 1_000, 0.1, 2)
    fill(v, 2, 1_000, 0.15, 2)
    assert v.ratio(1, 1_000) == pytest.approx(1.5)
    assert [(r, d) for r, d, *_ in v.snapshot()] == [(1, "0-2k"), (1, "16k+"), (2, "0-2k"), (2, "16k+")]
