"""gain.py's cost model fitted to measurements: a per-forward overhead plus bytes at a bandwidth, recovered from
decode rates it generated; the site models' published rates give cheap verify forwards (most of a step is overhead);
a machine's step times fitted by least squares."""

import pytest

from backends.decode.speculative.gain import (SHAPES, StepFit, decode_speedup, fit_published, fit_steps,
                                              forward_cost, read_bytes, verify_cost)
from backends.grading.rates import PUBLISHED_RATES


def test_fit_published_recovers_the_overhead_and_bandwidth_that_made_the_rates():
    shape = SHAPES["qwen3_moe"]
    true = StepFit(0.009, 650e9)
    rates = tuple((c, 1 / (true.overhead_s + read_bytes(shape, c, 1) / true.bytes_per_s)) for c in (0, 8000, 25000))
    fit = fit_published(shape, rates)
    assert fit.overhead_s == pytest.approx(0.009, rel=1e-6) and fit.bytes_per_s == pytest.approx(650e9, rel=1e-6)


def test_published_rates_put_most_of_a_step_in_overhead_and_verify_cheap():
    qwen, oss = SHAPES["qwen3_moe"], SHAPES["gpt_oss"]
    fq = fit_published(qwen, PUBLISHED_RATES["qwen3_moe"]["decode"])
    fo = fit_published(oss, PUBLISHED_RATES["gpt_oss"]["decode"])
    for shape, fit in ((qwen, fq), (oss, fo)):
        assert fit.overhead_s > read_bytes(shape, 0, 1) / fit.bytes_per_s  # more than half of a plain step
        assert 200e9 < fit.bytes_per_s < 819e9  # under the M3 Ultra's 819 GB/s
    for ctx in (6000, 15000, 25000):
        for k in (1, 2, 3):
            # far under the bytes-only model's price, and gpt-oss's bigger experts cost more than Qwen3-Coder's
            assert verify_cost(qwen, ctx, k, fit=fq) < 0.5 * verify_cost(qwen, ctx, k)
            assert 0.03 < verify_cost(qwen, ctx, k, fit=fq) < verify_cost(oss, ctx, k, fit=fo) < 0.3
    assert forward_cost(qwen, 6000, 1, fit=fq) == 1.0


def test_rates_that_do_not_fall_with_context_are_refused():
    with pytest.raises(ValueError, match="do not fall"):
        fit_published(SHAPES["gpt_oss"], ((0, 50.0), (25000, 60.0)))
    with pytest.raises(ValueError, match="two or more"):
        fit_published(SHAPES["gpt_oss"], ((0, 50.0),))


def test_speedup_counts_drafting_time_and_pays_nothing_without_acceptance():
    qwen = SHAPES["qwen3_moe"]
    fit = fit_published(qwen, PUBLISHED_RATES["qwen3_moe"]["decode"])
    assert decode_speedup(qwen, 15000, 0.0, 0.5, max_k=3, fit=fit) == (0, 1.0)
    k, free = decode_speedup(qwen, 15000, 0.8, 0.6, max_k=3, fit=fit)
    _, paid = decode_speedup(qwen, 15000, 0.8, 0.6, max_k=3, fit=fit, draft_cost=0.05)
    assert 1 <= k <= 3 and free > paid > 1.0
    # the fitted overhead makes a verify cheaper than bytes alone say: more gain at the same acceptance
    assert free > decode_speedup(qwen, 15000, 0.8, 0.6, max_k=3)[1]


def test_fit_steps_recovers_a_linear_step_model():
    a, b, c, d = 0.05, 0.004, 2e-6, 3e-8
    samples = [(n, ctx, a + b * (n - 1) + c * ctx + d * (n - 1) * ctx) for n in (1, 2, 4) for ctx in (256, 2048)]
    assert fit_steps(samples) == pytest.approx((a, b, c, d), rel=1e-6)
    with pytest.raises(ValueError, match="four or more"):
        fit_steps(samples[:3])
