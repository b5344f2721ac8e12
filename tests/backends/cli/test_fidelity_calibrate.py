"""`disagg fidelity calibrate` (backends/cli/fidelity.py) over fake nodes: n varied canaries through the pair, the
worst excess with its margin and each KV head's gain band written with date, reason and both KV identities; a pair
whose canary finds a wrong KV (not only its error's size) is not calibrated."""

from __future__ import annotations

import pytest

from backends.cli import fidelity
from kv_bridge.config.fidelity import read_calibrations
from tests.support.fakes import MODEL_ID, Cluster


async def test_calibrate_writes_the_pairs_allowance_tied_to_both_identities(empty_config, tmp_path):
    path = tmp_path / "cal.json"
    c = await Cluster(fidelity={"calibration_file": str(path)}).start()
    try:
        c.prefill.weights, c.decode.weights = {"scheme": "fp8", "bits": 8}, {"scheme": "affine", "bits": 4}
        c.decode.excess, lines = 0.4, []
        (cal,) = await fidelity.calibrate(c.settings, MODEL_ID, 3, reason="by the test", say=lines.append)
        bodies = c.decode.canary_bodies[-3:]
        assert [b["variant"] for b in bodies] == [0, 1, 2] and all(b["calibrate"] for b in bodies)
        assert bodies[0]["prefill_weights"] == {"scheme": "fp8", "bits": 8}
        assert (cal.allowance, cal.weights, cal.prefill_kv, cal.decode_kv, cal.canaries) == (0.5, "4", "kv0", "kv0", 3)
        assert "3 varied canaries" in cal.reason and cal.reason.endswith("by the test") and cal.date.startswith("20")
        assert read_calibrations(path) == [cal] and "allowance 0.5" in lines[-1]
        # each head's honest gains (the fake's: the same in every canary) widened by the least width, 0.06
        assert cal.gain_band[1]["v"] == [[0.84, 0.87], [0.96, 0.99]] and len(cal.gain_band) == 2
        assert "gain band 2 layers x 2 KV heads" in lines[-1]
    finally:
        await c.stop()


async def test_a_canary_that_finds_a_wrong_kv_is_not_calibrated(empty_config, tmp_path):
    path = tmp_path / "cal.json"
    c = await Cluster(fidelity={"calibration_file": str(path)}).start()
    try:
        c.decode.fidelity_error = 0.5  # failed, and not on its error's size alone
        with pytest.raises(RuntimeError, match="canary 1 of .* not calibrated"):
            await fidelity.calibrate(c.settings, MODEL_ID, 2, say=lambda _: None)
        assert not path.exists()
    finally:
        await c.stop()


def test_the_allowance_is_the_worst_excess_with_its_margin_and_a_floor():
    assert fidelity.allowance_of([0.1, 0.4, 0.2]) == 0.5 and fidelity.allowance_of([0.001]) == fidelity.FLOOR
    with pytest.raises(ValueError):
        fidelity.allowance_of([])
