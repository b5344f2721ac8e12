"""The KV fault catalogue of the fidelity canary (issues #41, #50), as what a wrong layout adapter, wire, block table or
cache would hand the decode node: functions of the prefill side's per-layer KV [{"k", "v"}: (H, T, D) float32] -> the
same."""

from __future__ import annotations

from typing import Callable

import numpy as np

from kv_bridge import dtypes


def mlx_prefill_kv(model, ids: list[int]) -> list[dict]:
    """An mlx-lm model's own KV of `ids` in the catalogue's form [{"k", "v"}: (H, T, D) float32], one prefill."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    return [{"k": np.array(c.state[0][0, :, :len(ids)].astype(mx.float32)),
             "v": np.array(c.state[1][0, :, :len(ids)].astype(mx.float32))} for c in cache]


def _each(layers: list[dict], fn) -> list[dict]:
    return [{t: fn(t, li, x) for t, x in row.items()} for li, row in enumerate(layers)]


def kv_swapped(layers, **_):
    return [{"k": r["v"], "v": r["k"]} for r in layers]


def layer_shifted(layers, **_):
    """Layer i carries layer i+1's KV (the last its own): an off-by-one in the connector's layer index."""
    return [layers[min(i + 1, len(layers) - 1)] for i in range(len(layers))]


def heads_swapped(layers, **_):
    """KV heads 0 and 1 exchanged in every layer (a head stride misread)."""
    return _each(layers, lambda t, li, x: x[[1, 0, *range(2, x.shape[0])]])


def rope_off_by_one(layers, rope: Callable | None = None, **_):
    """K rotated as if every position were one more (a position offset in the prefill)."""
    return [{"k": rope(r["k"], li, 1), "v": r["v"]} for li, r in enumerate(layers)]


def window_misplaced(layers, shift: int = 8, **_):
    """Every held position carries the KV of `shift` positions earlier (a sliding window cut at the wrong start)."""
    return _each(layers, lambda t, li, x: np.concatenate([x[:, :shift], x[:, :-shift]], axis=1))


def dtype_misread(layers, **_):
    """bfloat16 bytes read as float16."""
    return _each(layers, lambda t, li, x: dtypes.to_bfloat16(x).view(np.float16).astype(np.float32))


def fp8_scale_off(layers, **_):
    """K's fp8 scale 25% too large in every frame."""
    return [{"k": r["k"] * 1.25, "v": r["v"]} for r in layers]


def v_too_large(layers, **_):
    return [{"k": r["k"], "v": r["v"] * 1.2} for r in layers]


def stale_prefix(layers, other: list[dict] | None = None, **_):
    """The first half of the positions hold another prompt's KV (a decode node's held prefix that is not this
    prompt's): `other` is that prompt's KV, same geometry."""
    def mix(t, li, x):
        n = x.shape[1] // 2
        return np.concatenate([other[li][t][:, :n], x[:, n:]], axis=1)
    return _each(layers, mix)


def scaled_down(layers, **_):
    """V x0.85 (a downward scale: an fp8 scale read too small)."""
    return [{"k": r["k"], "v": r["v"] * 0.85} for r in layers]


def k_scaled_down(layers, **_):
    return [{"k": r["k"] * 0.85, "v": r["v"]} for r in layers]


def _blocks(x: np.ndarray, block: int) -> int:
    return x.shape[1] // block


def zero_blocks(layers, block: int = 16, at: tuple[int, ...] | None = None, **_):
    """Blocks `at` read as zeros (block-table entries pointing at fresh blocks); default every third block from the
    second: ~30% of the positions, which the canary's averages used to pass."""
    def zero(t, li, x):
        x = x.copy()
        for b in at if at is not None else range(1, x.shape[1] // block, 3):
            x[:, b * block:(b + 1) * block] = 0
        return x
    return _each(layers, zero)


def block_swapped(layers, block: int = 16, a: int = 1, b: int = 5, **_):
    """Blocks `a` and `b` exchanged (two block-table entries swapped)."""
    def swap(t, li, x):
        if (b + 1) * block > x.shape[1]:
            return x
        x = x.copy()
        x[:, a * block:(a + 1) * block], x[:, b * block:(b + 1) * block] = \
            x[:, b * block:(b + 1) * block].copy(), x[:, a * block:(a + 1) * block].copy()
        return x
    return _each(layers, swap)


def other_block(layers, other: list[dict] | None = None, block: int = 16, at: int = 3, **_):
    """Block `at` holds another request's KV of the same positions (a block shared in a mixed batch)."""
    def mix(t, li, x):
        x = x.copy()
        x[:, at * block:(at + 1) * block] = other[li][t][:, at * block:(at + 1) * block]
        return x
    return _each(layers, mix)


def slot_shift(layers, first: int = 64, **_):
    """From position `first` on (a later prefill step) each position holds the one before it (slot mapping one off)."""
    return _each(layers, lambda t, li, x: np.concatenate([x[:, :first], x[:, first - 1:-1]], axis=1))


def head_scaled(layers, head: int = 0, **_):
    """One KV head's V x1.2 (a per-head scale: a layer's gain reads ~1.05 over four heads)."""
    def scale(t, li, x):
        if t != "v":
            return x
        x = x.copy()
        x[head] *= 1.2
        return x
    return _each(layers, scale)


def window_cut(layers, window: int = 128, **_):
    """A full-attention layer cut to a 128-token window: every position before the last `window` zero (on a canary
    shorter than twice that, its last half)."""
    def cut(t, li, x):
        x = x.copy()
        x[:, :x.shape[1] - min(window, x.shape[1] // 2)] = 0
        return x
    return _each(layers, cut)


FAULTS = {"K/V swapped": kv_swapped, "layer shifted by one": layer_shifted, "KV heads 0/1 swapped": heads_swapped,
          "RoPE positions +1": rope_off_by_one, "window misplaced by 8": window_misplaced,
          "bf16 read as f16": dtype_misread, "fp8 K scale x1.25": fp8_scale_off, "V x1.2": v_too_large,
          "stale prefix": stale_prefix, "V x0.85": scaled_down, "K x0.85": k_scaled_down,
          "zero-filled blocks": zero_blocks, "two blocks swapped": block_swapped,
          "another request's block": other_block, "slot mapping shifted": slot_shift, "one V head x1.2": head_scaled,
          "128-token window cut": window_cut}


def last_layer_head(layers, scale: float = 1.2, tensor: str = "v", head: int = 0, **_):
    """One KV head of the last layer scaled (a per-head scale on the layer a quantized Mac reads lowest gains on):
    within the class's gain bounds on a noisy pair, outside the pair's calibrated band."""
    out = [dict(r) for r in layers]
    out[-1] = {**out[-1], tensor: out[-1][tensor].copy()}
    out[-1][tensor][head] *= scale
    return out


# Faults the class's bounds may let through on a quantized pair and the pair's calibrated gain band catches
# (bench/bench_fidelity.py reports them "caught*"; not in FAULTS, which every class must catch).
BAND_FAULTS = {"last layer V head x1.2": last_layer_head,
               "last layer V head x0.85": lambda layers, **kw: last_layer_head(layers, 0.85)}
