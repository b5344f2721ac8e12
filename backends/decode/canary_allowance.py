"""A pair's own error allowance (`disagg fidelity calibrate`, docs/kv_bridge.md "Calibration"): what one canary's
error magnitude needs past the wire's own (`measure`), and a verdict's magnitude findings judged again against the
pair's calibrated allowance instead of its class's (`rejudge`). Placement, position and gain are never touched."""

from __future__ import annotations

import numpy as np

PAST_WIRE = "rel. RMS past the wire"  # a head's rel. RMS less WIRE_FACTOR x the wire's own: what an allowance covers
MAGNITUDE = ("rel. RMS", PAST_WIRE)  # the metrics that read the error's size alone, not where or at what scale


def measure(bridged: list, reference: list, wire: str, sent_from=None, start: int = 0) -> dict:
    """MLX thread, after the comparison: the rel. RMS allowance this canary needs, its worst head's (relative RMS
    minus WIRE_FACTOR x the wire's own on the same KV, as the metric's tolerance is built) ->
    {"excess": value, "excess_at": {"tensor", "layer", "head", "value"}}."""
    from kv_bridge.mlx.fidelity import held_pairs
    from kv_bridge.mlx.fidelity_metric import WIRE_FACTOR, head_stats, wire_encode

    got, ref = held_pairs(bridged, reference, sent_from, start)  # a sliding layer: the window that crossed
    worst = {"tensor": None, "layer": None, "head": None, "value": -np.inf}
    for li, (b, r) in enumerate(zip(got, ref)):
        for t in ("k", "v"):
            rel = head_stats(b[t], r[t])["rel"]
            if not rel.size:
                continue
            need = rel - WIRE_FACTOR * head_stats(wire_encode(r[t], wire), r[t])["rel"]
            h = int(np.argmax(need))
            if need[h] > worst["value"]:
                worst = {"tensor": t.upper(), "layer": li, "head": h, "value": float(need[h])}
    worst["value"] = max(0.0, worst["value"])  # within the wire's own: needs no allowance at all
    return {"excess": worst["value"], "excess_at": worst}


def rejudge(findings: list[dict], excess_at: dict, allowance: float) -> list[dict]:
    """`findings` with their magnitude ones replaced by one against the calibrated `allowance` (past the wire's own),
    when this canary's excess is beyond it; the furthest past its tolerance first."""
    out = [f for f in findings if f["metric"] not in MAGNITUDE]
    if excess_at["value"] > allowance:
        out.append({"metric": PAST_WIRE, "tensor": excess_at["tensor"], "layer": excess_at["layer"],
                    "head": excess_at["head"], "value": excess_at["value"], "tolerance": allowance,
                    "what": "error beyond the wire and the pair's calibrated allowance"})
    return sorted(out, key=lambda f: -f["value"] / max(f["tolerance"], 1e-30))


def nearest(excess_at: dict, allowance: float) -> dict:
    """The worst figure of a canary judged by a calibrated allowance that nothing failed."""
    return {"metric": PAST_WIRE, "tensor": excess_at["tensor"], "layer": excess_at["layer"],
            "head": excess_at["head"], "value": excess_at["value"], "tolerance": allowance}


def magnitude_only(findings: list[dict]) -> bool:
    """Every finding reads the error's size alone: placement, position and gain all hold."""
    return bool(findings) and all(f["metric"] in MAGNITUDE for f in findings)
