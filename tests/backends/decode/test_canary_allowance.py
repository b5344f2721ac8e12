"""The canary's verdict by the pair's class and allowance (backends/decode/canary.py verdict, canary_allowance.py):
on quantized weights an error past its allowance alone, placement, position and gain holding, is "verified, over
allowance" naming the calibrate command; with the same weights, or with any structural finding, it fails; a pair's
calibrated allowance replaces its class's for the error's size only."""

from __future__ import annotations

from backends.decode.canary import verdict

WORST = {"metric": "rel. RMS", "tensor": "V", "layer": 3, "head": 1, "value": 1.1, "tolerance": 0.93}
REL = {**WORST, "what": "error beyond the wire and the weights"}
GAIN = {"metric": "|gain - 1|", "tensor": "V", "layer": 2, "head": None, "value": 0.2, "tolerance": 0.05,
        "what": "V scaled by 1.2"}


def _out(findings, weights, **kw) -> dict:
    return {"worst": findings[0] if findings else WORST, "findings": findings, "weights": weights, "layers": [],
            "greedy": None, "kl": None, "seconds": 0.1, **kw}


def test_on_quantized_weights_an_error_past_its_allowance_alone_is_verified_over_allowance():
    v = verdict("qwen", "mac-0", "bfloat16", "float8_e4m3", 255, _out([REL], "4"))
    assert v.state == "verified" and v.over_allowance and v.ok
    assert "disagg fidelity calibrate --model qwen" in v.message and "(over allowance)" in v.summary()
    assert v.greedy is None and "greedy" not in v.summary()


def test_the_same_weights_or_a_structural_finding_still_fail():
    assert verdict("m", "mac-0", "float32", "float32", 255, _out([REL], "full")).state == "failed"
    v = verdict("m", "mac-0", "bfloat16", "float8_e4m3", 255, _out([GAIN, REL], "4"))
    assert v.state == "failed" and not v.over_allowance and v.metric == "|gain - 1|"


def test_a_calibrated_allowance_judges_the_error_size_in_place_of_the_class():
    at = {"tensor": "V", "layer": 3, "head": 1, "value": 0.6}
    v = verdict("m", "mac-0", "bfloat16", "float8_e4m3", 255, _out([REL], "4", allowance=0.75, excess=0.6,
                                                                 excess_at=at))
    assert v.state == "verified" and not v.over_allowance and v.findings == []
    assert (v.error, v.tolerance, v.allowance) == (0.6, 0.75, 0.75)
    v = verdict("m", "mac-0", "bfloat16", "float8_e4m3", 255, _out([], "8", allowance=0.3, excess=0.6, excess_at=at))
    assert v.over_allowance and "calibrated allowance" in v.findings[0]["what"]  # tighter than the class's
    v = verdict("m", "mac-0", "bfloat16", "float8_e4m3", 255, _out([GAIN, REL], "4", allowance=0.75, excess_at=at))
    assert v.state == "failed" and [f["metric"] for f in v.findings] == ["|gain - 1|"]
