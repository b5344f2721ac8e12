"""The fidelity canary's metric and rule (numpy, and MLX's fp8 rounding): per layer, tensor and KV head, what the bridged KV reads against
MLX's own, against what the wire's own encoding of MLX's KV reads, and whether it sits in its own slot at all.

Arrays per layer are (H, T, D) float32 over the positions both caches hold. Three tests, each invariant to an honest
difference of weights (docs/kv_bridge.md, "The fidelity canary"):
- placement: each head's KV is nearer MLX's own head than any rival slot (another head, the other tensor, the next
  or previous layer, K rotated one position more or less). Honest noise has no structure, so its own slot always
  wins; a swap, a shifted layer or RoPE positions off by one make a rival win. No tolerance.
- gain: <bridged, mlx> / <mlx, mlx> per layer and tensor (a scale fault: an fp8 scale, V too large), within
  [1 / (1 + rel^2), 1] (GAIN); cosine is blind to scale, relative RMS mixes it with noise.
- error: relative RMS per head, and per position of the first layer (a function of token and position alone, so a
  stale prefix or a misplaced window shows there), against the wire's own error on the same KV plus an allowance
  for the two sides' weights and kernels (WEIGHTS).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from kv_bridge import dtypes, fidelity

# Allowance for the two sides computing with different weights / kernels, by the decode model's weight precision,
# added to the wire's measured floor: (relative RMS per head, first-layer error per position). Measured by
# bench/bench_fidelity.py, worst over every canary (docs/kv_bridge.md, "The fidelity canary"): SmolLM2 float32
# prefill against mlx-lm's own 8-bit 0.048 / 0.012, 4-bit 0.64 / 0.25-0.36; "full" (the same weights, bf16 kernels
# on one side): the tiny gpt_oss in bf16 against float32 0.178 (a random MoE's expert routing flips on near-ties).
# Faults are told apart by placement, gain and position, not by this error alone.
WEIGHTS = {"full": (0.3, 0.1), "8": (0.3, 0.1), "4": (0.85, 0.45)}
# Gain: noise in MLX's own KV (r = b + n) pulls <b, r> / <r, r> down to 1 / (1 + rel^2), noise in the bridged KV
# leaves it at 1; so an honest layer's gain lies in [1 / (1 + rel^2), 1] give or take this (4-bit SmolLM2: V layer
# gains 0.82-0.99, K up to 1.005). A scale fault s > 1 lifts it past 1.
GAIN = 0.05
WIRE_FACTOR = 3.0  # the wire's own error may read up to 3x higher on KV the prefill side computed
TENSORS = ("k", "v")


def wire_encode(x: np.ndarray, wire: str, chunk: int | None = None) -> np.ndarray:
    """(H, T, D) float32 as the wire carries it back to float32: bf16 / f16 rounding; fp8 e4m3 scaled per frame
    (amax / 448 over heads, `chunk` positions a frame as prefill steps send them; one frame when None)."""
    if wire == "float32":
        return x
    if wire == "bfloat16":
        return dtypes.to_float32(dtypes.to_bfloat16(x), "bfloat16")
    if wire == "float16":
        return x.astype(np.float16).astype(np.float32)
    if wire != "float8_e4m3":
        raise ValueError(f"unknown wire dtype {wire!r}")
    out, step = np.empty_like(x), chunk or x.shape[1] or 1
    for s in range(0, x.shape[1], step):
        part = x[:, s:s + step]
        scale = max(float(np.abs(part).max()) / dtypes.E4M3_MAX, 1e-12)
        # MLX's e4m3 rounding (nearest, saturating): the same codes as dtypes.e4m3_encode, ~10x faster
        out[:, s:s + step] = np.array(mx.from_fp8(mx.to_fp8(mx.array(part / np.float32(scale))), dtype=mx.float32))
        out[:, s:s + step] *= np.float32(scale)
    return out


def _sq(a: np.ndarray) -> np.ndarray:
    return (a * a).sum(axis=(-2, -1))


def head_stats(b: np.ndarray, r: np.ndarray) -> dict:
    """Per head of (H, T, D) pairs: relative RMS, cosine, gain; and the old max metric of the whole tensor."""
    rr, bb, br = _sq(r), _sq(b), (b * r).sum(axis=(-2, -1))
    d = b - r
    eps = 1e-30
    return {"rel": np.sqrt(_sq(d) / np.maximum(rr, eps)), "cos": br / np.sqrt(np.maximum(bb * rr, eps)),
            "gain_layer": float(br.sum() / max(rr.sum(), eps)), "gain": br / np.maximum(rr, eps),
            "max": float(np.abs(d).max() / max(float(np.abs(r).max()), eps)) if d.size else 0.0}


def position_error(b: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Per position of (H, T, D): the error over heads and channels relative to the layer's RMS position norm."""
    per = np.sqrt((((b - r) ** 2).sum(axis=(0, 2))))
    return per / max(float(np.sqrt((r * r).sum(axis=(0, 2)).mean())), 1e-30)


def _rel(b: np.ndarray, r: np.ndarray) -> float:
    return float(np.sqrt(_sq(b - r) / max(float(_sq(r)), 1e-30)))


def placement(bridged: list[dict], reference: list[dict], rope: Callable | None) -> dict | None:
    """The worst misplaced head: {"tensor", "layer", "head", "rival", "value"} where `value` is the rival slot's
    error over the own slot's (below PLACEMENT it matches the rival better), or None when every head is home.
    `bridged`/`reference`: per layer {"k", "v"} (H, T, D); rope(x, layer, d): K rotated d positions more."""
    worst = None
    for li, (bl, rl) in enumerate(zip(bridged, reference)):
        shifted = {d: rope(rl["k"], li, d) for d in (1, -1)} if rope is not None else {}
        for t in TENSORS:
            other = "v" if t == "k" else "k"
            for h in range(bl[t].shape[0]):
                own = _rel(bl[t][h], rl[t][h])
                rivals = {f"{t.upper()} head {g}": rl[t][g] for g in range(rl[t].shape[0]) if g != h}
                rivals[f"{other.upper()} head {h}"] = rl[other][h] if rl[other].shape == rl[t].shape else None
                for nl in (li - 1, li + 1):
                    if 0 <= nl < len(reference) and reference[nl][t].shape == rl[t].shape:
                        rivals[f"layer {nl}"] = reference[nl][t][h]
                if t == "k":
                    for d, x in shifted.items():
                        rivals[f"positions {d:+d}"] = x[h]
                for name, x in rivals.items():
                    if x is None or x.shape != bl[t][h].shape or own == 0.0:
                        continue
                    ratio = _rel(bl[t][h], x) / own
                    if worst is None or ratio < worst["value"]:
                        worst = {"tensor": t.upper(), "layer": li, "head": h, "rival": name, "value": ratio}
    return worst if worst is not None and worst["value"] < PLACEMENT else None


PLACEMENT = 0.8  # a rival slot nearer by 20%: honest noise leaves it at >= ~1.0 (it adds to the rival's distance)


def arrived(layers: list[dict], start: int) -> list[dict]:
    """Each layer's positions from `start` on (the ones that arrived as KV after a held prefix); a layer holding
    only the newest positions (a window) keeps those past `start`."""
    total = max((r["k"].shape[1] for r in layers), default=0)
    out = []
    for r in layers:
        skip = max(0, start - (total - r["k"].shape[1]))
        out.append({t: x[:, skip:] for t, x in r.items()})
    return out


# Gain per KV head (issue #50: one head of four x1.2 read ~1.05 per layer). Its bounds come from the pair's calibrated
# band (kv_bridge/fidelity.py's gain_band, from honest canaries of the pair, written by `disagg fidelity calibrate`)
# within the weights' allowance, or from that allowance alone: never from the judged layer's own error, which a fault
# widens (V x0.88 passed at an honest error of 0.3).
# Positions on every layer: faults come in blocks (a block, a step, a window), noise does not. A run of at least
# POS_RUN positions each past POS_FACTOR x the layer's own median error (+ the wire's own, + POS_ABS) is misplaced.
POS_FACTOR, POS_RUN, POS_ABS = 4.0, 4, 0.05


def gain_band(honest: list[dict]) -> list[dict]:
    """The pair's calibrated gain band from judge() results of honest canaries (kv_bridge.fidelity.gain_band)."""
    return fidelity.gain_band([j["layers"] for j in honest])


def _gain_findings(li: int, t: str, gains: np.ndarray, band: list | None, a_rel: float, gtol: float) -> list:
    """Heads whose gain lies outside [1 / (1 + a_rel^2), 1] +- gtol (the weights' allowance: "|gain - 1|"), or
    outside the pair's calibrated band ([lo per head, hi per head]) within it ("|gain - band mid|", its half-width
    the tolerance): a band tightens both bounds, never loosens them (4-bit SmolLM2's V heads read 0.77-0.99: one of
    them x1.2 stays under the class's 1 + gtol, not under its own band)."""
    c_lo, c_hi = 1 / (1 + a_rel ** 2) - gtol, 1 + gtol
    lo, hi = np.full(gains.shape, c_lo), np.full(gains.shape, c_hi)
    if band is not None:
        b_lo, b_hi = (np.asarray(x, dtype=np.float64) for x in band)
        if b_lo.shape != gains.shape or b_hi.shape != gains.shape:
            raise ValueError(f"the pair's calibrated gain band has {b_lo.size} {t.upper()} heads at layer {li}, the "
                             f"KV {gains.size}: run `disagg fidelity calibrate` again")
        lo, hi = np.maximum(lo, b_lo), np.minimum(hi, b_hi)
    out = []
    for h in np.flatnonzero((gains < lo) | (gains > hi)):
        g, what = float(gains[h]), f"{t.upper()} head {h} scaled by {gains[h]:.3g}"
        if band is None or not c_lo <= g <= c_hi:
            out.append({"metric": "|gain - 1|", "tensor": t.upper(), "layer": li, "head": int(h), "value": abs(g - 1),
                        "tolerance": float(c_hi - 1 if g > 1 else 1 - c_lo), "what": what})
        else:
            out.append({"metric": "|gain - band mid|", "tensor": t.upper(), "layer": li, "head": int(h),
                        "value": abs(g - (lo[h] + hi[h]) / 2), "tolerance": float(hi[h] - lo[h]) / 2,
                        "what": f"{what}, outside the pair's calibrated band {lo[h]:.3g}-{hi[h]:.3g}"})
    return out


def _runs(bad: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], bad.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def position_runs(li: int, t: str, b: np.ndarray, r: np.ndarray, wire: str, chunk: int | None) -> dict | None:
    """The longest run of >= POS_RUN positions of one layer and tensor whose error is far above the layer's own
    median (another token's, another position's or no KV there), or None."""
    if r.shape[1] < 2 * POS_RUN:
        return None
    err, floor = position_error(b, r), position_error(wire_encode(r, wire, chunk), r)
    tol = POS_FACTOR * float(np.median(err)) + WIRE_FACTOR * floor + POS_ABS
    runs = [(a, e) for a, e in _runs(err > tol) if e - a >= POS_RUN]
    if not runs:
        return None
    a, e = max(runs, key=lambda x: x[1] - x[0])
    p = a + int(np.argmax(err[a:e] / tol[a:e]))
    return {"metric": "position error", "tensor": t.upper(), "layer": li, "head": None, "value": float(err[p]),
            "tolerance": float(tol[p]), "what": f"positions {a}-{e - 1} of {err.size} far above layer {li}'s median "
                                                f"error: another token's or no KV"}


def judge(bridged: list[dict], reference: list[dict], wire: str, weights: str, chunk: int | None = None,
          rope: Callable | None = None, start: int = 0, band: list[dict] | None = None) -> dict:
    """The canary's figures and findings. Returns {"layers": [per-layer row], "findings": [...], "worst": finding}
    where a finding is {"metric", "tensor", "layer", "head", "value", "tolerance", "what"}; "worst" is the first
    failing one, or the head nearest its tolerance when none fails. `start`: positions before it were held by the
    decode node (a reused prefix), the placement and per-layer position tests look at the ones after. `band`: the
    pair's calibrated gain band (gain_band()), within the weights' allowance; else that allowance bounds each head's
    gain."""
    if weights not in WEIGHTS:
        raise ValueError(f"no fidelity allowance for weights {weights!r}; known: {', '.join(WEIGHTS)}")
    if band is not None and len(band) != len(bridged):
        raise ValueError(f"the pair's calibrated gain band has {len(band)} layers, the KV {len(bridged)}: run "
                         f"`disagg fidelity calibrate` again")
    a_rel, a_pos = WEIGHTS[weights]
    rows, findings, nearest = [], [], None
    sent, own = arrived(bridged, start), arrived(reference, start)  # the positions that came as KV
    for li, (bl, rl) in enumerate(zip(bridged, reference)):
        row = {"layer": li, "tokens": int(rl["k"].shape[1])}
        for t in TENSORS:
            s = head_stats(bl[t], rl[t])
            floor = head_stats(wire_encode(rl[t], wire, chunk), rl[t])
            tol = WIRE_FACTOR * floor["rel"] + a_rel
            h = int(np.argmax(s["rel"] / tol)) if s["rel"].size else 0
            gtol = WIRE_FACTOR * abs(floor["gain_layer"] - 1) + GAIN
            rel_l = float(np.sqrt(_sq(bl[t] - rl[t]).sum() / max(float(_sq(rl[t]).sum()), 1e-30)))
            low = 1 / (1 + rel_l ** 2) - gtol  # what noise in MLX's own KV alone does to the gain
            row.update({t: float(s["rel"].max(initial=0.0)), f"{t}_head": h, f"{t}_tol": float(tol[h]),
                        f"{t}_cos": float(s["cos"].min(initial=1.0)), f"{t}_gain": s["gain_layer"],
                        f"{t}_max": s["max"], f"{t}_floor": float(floor["rel"].max(initial=0.0))})
            fig = {"metric": "rel. RMS", "tensor": t.upper(), "layer": li, "head": h, "value": float(s["rel"][h]),
                   "tolerance": float(tol[h])} if s["rel"].size else None
            if fig and (nearest is None or fig["value"] / fig["tolerance"] > nearest["value"] / nearest["tolerance"]):
                nearest = fig
            if fig and fig["value"] > fig["tolerance"]:
                findings.append({**fig, "what": "error beyond the wire and the weights"})
            g = s["gain_layer"]
            if g > 1 + gtol or g < low:
                findings.append({"metric": "|gain - 1|", "tensor": t.upper(), "layer": li, "head": None,
                                 "value": abs(g - 1), "tolerance": gtol if g > 1 else 1 - low,
                                 "what": f"{t.upper()} scaled by {g:.3g}"})
            # Per head over the positions that arrived (a held prefix is MLX's own: it would pull a gain to 1)
            gains = head_stats(sent[li][t], own[li][t])["gain"] if sent[li][t].shape[1] else None
            row[f"{t}_gains"] = [] if gains is None else [float(x) for x in gains]
            if gains is not None:
                findings += _gain_findings(li, t, gains, band[li][t] if band else None, a_rel, gtol)
            if li > 0:  # layer 0: the absolute test below
                run = position_runs(li, t, sent[li][t], own[li][t], wire, chunk)
                findings += [run] if run else []
        rows.append(row)
    if bridged:
        for t in TENSORS:  # the first layer: a function of (token, position) only
            b0, r0 = bridged[0][t], reference[0][t]
            err, floor = position_error(b0, r0), position_error(wire_encode(r0, wire, chunk), r0)
            tol = WIRE_FACTOR * floor + a_pos
            if err.size and (err > tol).any():
                p = int(np.argmax(err - tol))
                findings.append({"metric": "position error", "tensor": t.upper(), "layer": 0, "head": None,
                                 "value": float(err[p]), "tolerance": float(tol[p]),
                                 "what": f"held position {p} of {err.size} is another token's"})
    findings.sort(key=lambda f: -f["value"] / f["tolerance"])  # the furthest past its tolerance first
    misplaced = placement(sent, own, rope)
    if misplaced is not None:
        findings.insert(0, {"metric": "placement", "tensor": misplaced["tensor"], "layer": misplaced["layer"],
                            "head": misplaced["head"], "value": misplaced["value"], "tolerance": PLACEMENT,
                            "what": f"matches MLX's {misplaced['rival']} better than its own slot"})
    return {"layers": rows, "findings": findings, "worst": findings[0] if findings else nearest}
