"""The KV check on real traffic (issue #50): layer 0's K/V at a position is a function of the token there and the
position alone (embedding -> norm -> K/V projections -> RoPE for K, no attention), so the decode node recomputes it
for every transfer at about 1/L of a prefill and tests each position that arrived against it, before decoding on it.

A block-table, slot-mapping, chunking, window or prefix-hit fault puts another token's (or another position's, or no)
KV at some position; the canary, one short prompt, never exercises most of those paths, a real prompt of 6-25k tokens
does. The test is the canary's first-layer position test (kv_bridge/mlx/fidelity_metric.py) with the same allowance.
"""

from __future__ import annotations

import time
from typing import Generator

import mlx.core as mx
import numpy as np

from kv_bridge import dtypes
from kv_bridge.mlx.fidelity_metric import WEIGHTS, WIRE_FACTOR, position_error, wire_encode

# Tokens recomputed at a time (bounded memory). All in one step of the MLX thread: the work is ~1/L of a prefill
# (milliseconds on a Mac even at 25k tokens), while each step waits a whole batch step, seconds under a local prefill.
PIECE = 2048


class _Captured(Exception):
    def __init__(self, keys: mx.array, values: mx.array):
        super().__init__("layer 0's K/V captured")
        self.keys, self.values = keys, values


class _Capture:
    """mlx-lm's cache protocol (`offset`, `update_and_fetch`) for one call: the layer's attention hands it its new
    K/V, RoPE applied at `offset`, and it stops the layer there, so no attention is computed."""

    def __init__(self, offset: int):
        self.offset = offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        raise _Captured(keys, values)


def layer0_kv(model, ids: list[int], start: int, piece: int = PIECE) -> Generator[None, None, tuple]:
    """MLX's own layer-0 K and V of tokens `ids` at positions [start, start + len(ids)): (H, T, D) float32 each,
    `piece` tokens at a time, one step in all. The model's own modules run (any family: Q/K norms, RoPE scaling,
    biases as it has them)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is None or not getattr(model, "layers", None):
        raise ValueError(f"{type(model).__module__}: no model.embed_tokens / layers to recompute layer 0 with")
    ks, vs = [], []
    for s in range(0, len(ids), piece):
        h = embed(mx.array(ids[s:s + piece])[None])
        try:
            model.layers[0](h, None, _Capture(start + s))
        except _Captured as c:
            ks.append(np.array(c.keys[0].astype(mx.float32)))
            vs.append(np.array(c.values[0].astype(mx.float32)))
        else:
            raise ValueError("layer 0 never handed its K/V to the cache: this family cannot be checked this way")
    yield
    return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)


def arrived_first(kv, layer: int) -> int:
    """The first position of `layer` the transfer carried (a sliding layer's window starts late), as an index into
    the transfer's arrays."""
    firsts = getattr(kv, "layer_first", None)
    return 0 if firsts is None else int(firsts[layer]) - kv.start


def judge(got: dict, ref: dict, wire: str, weights: str, first: int = 0) -> dict | None:
    """The worst position of layer 0 past its tolerance, or None: `got`/`ref` {"k", "v"} (H, T, D) float32 over the
    transfer's positions, `first` the index of the first one that arrived (earlier ones are not judged)."""
    if weights not in WEIGHTS:
        raise ValueError(f"no fidelity allowance for weights {weights!r}; known: {', '.join(WEIGHTS)}")
    a_pos = WEIGHTS[weights][1]
    worst = None
    for t in ("k", "v"):
        b, r = got[t][:, first:], ref[t][:, first:]
        if not r.shape[1]:
            continue
        err, floor = position_error(b, r), position_error(wire_encode(r, wire), r)
        tol = WIRE_FACTOR * floor + a_pos
        bad = err > tol
        if bad.any():
            p = int(np.argmax(err / tol))
            f = {"tensor": t.upper(), "position": first + p, "value": float(err[p]), "tolerance": float(tol[p]),
                 "positions": int(bad.sum()), "of": int(err.size)}
            if worst is None or f["value"] / f["tolerance"] > worst["value"] / worst["tolerance"]:
                worst = f
    return worst


def check(model, ids: list[int], kv, wire: str, weights: str) -> Generator[None, None, dict]:
    """MLX thread, step by step: the received layer-0 KV of `kv` (kv_bridge.assembly.ReceivedKV, prompt positions
    [kv.start, kv.start + T)) against MLX's own of `ids` there. -> {"ok", "finding", "tokens", "seconds"}."""
    t0 = time.perf_counter()
    n = kv.keys.shape[2]
    k, v = yield from layer0_kv(model, ids[kv.start:kv.start + n], kv.start)
    got = {"k": dtypes.to_float32(kv.keys[0], kv.dtype), "v": dtypes.to_float32(kv.values[0], kv.dtype)}
    finding = judge(got, {"k": k, "v": v}, wire, weights, arrived_first(kv, 0))
    return {"ok": finding is None, "finding": finding, "tokens": n, "seconds": time.perf_counter() - t0}


def describe(finding: dict) -> str:
    """One line for the log and the done line: where the layer-0 KV is not the prompt's."""
    return (f"{finding['tensor']} layer 0 position {finding['position']} error {finding['value']:.3g} (tolerance "
            f"{finding['tolerance']:.3g}; {finding['positions']} of {finding['of']} positions past it): another "
            f"token's or position's KV")
