"""The fidelity canary's MLX side: MLX's own prefill of the canary tokens, the bridged cache compared with it layer by
layer, and greedy tokens from each. Every step is a generator that yields between pieces of work, so the decode
node's MLX thread interleaves it with its batch (backends/decode/engine.py, MLXModel.run_task).

Caches compared as mlx-lm holds them, in temporal order (1, H, held, D): a KVCache holds positions [0, T); a
RotatingKVCache the last ones (its first `keep` too), the bridged one its window, MLX's own after a chunked prefill
window - 1 + the last chunk: the positions both hold are compared.
"""

from __future__ import annotations

from typing import Generator

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

CHUNK = 32  # tokens of MLX's own prefill per step of the MLX thread (~0.1 s on mlx-cpu here, ~10 ms on a Mac)


def prefill(model, ids: list[int], chunk: int = CHUNK) -> Generator[None, None, list]:
    """MLX's own prefill of `ids`, `chunk` tokens a step (never a 1-token step: that would rotate a sliding cache
    out of temporal order); returns the cache."""
    cache = make_prompt_cache(model)
    starts = list(range(0, len(ids), chunk))
    if len(starts) > 1 and len(ids) - starts[-1] == 1:
        starts.pop()  # the last lone token joins the chunk before it
    for i, s in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(ids)
        model(mx.array(ids[s:end])[None], cache=cache)
        mx.eval([c.state for c in cache])
        yield
    return cache


def _held(c) -> tuple[mx.array, mx.array, int, int]:
    """(keys, values) a cache holds in temporal order, its offset and keep."""
    if isinstance(c, RotatingKVCache):
        k, v, offset, keep, _, idx = c.state
        if idx != k.shape[2]:
            raise ValueError("a RotatingKVCache out of temporal order cannot be compared")
        return k, v, offset, keep
    if isinstance(c, KVCache):
        k, v, offset = c.state  # a buffer that may run past offset
        return k[..., :offset, :], v[..., :offset, :], offset, 0
    raise ValueError(f"the canary compares KVCache and RotatingKVCache, not {type(c).__name__}")


def _positions(n: int, held: int, keep: int) -> np.ndarray:
    """Indices into a temporal buffer of `held` entries of the `n` newest positions (the first `keep` included)."""
    return np.concatenate([np.arange(min(keep, n)), np.arange(held - (n - min(keep, n)), held)])


def _f32(a: mx.array, idx: np.ndarray) -> np.ndarray:
    return np.array(a[0][:, mx.array(idx)].astype(mx.float32))


def held_pairs(bridged: list, reference: list, sent_from=None, start: int = 0) -> tuple[list[dict], list[dict]]:
    """Per layer {"k", "v"} (H, n, D) float32 of each cache over the n positions both hold, in temporal order.
    `sent_from` (the received KV's first position per layer) past `start` marks a sliding layer whose window is all
    that crossed: a held prefix with KV appended (append_kv) holds placeholders before it, which no decode step
    attends to (mlx-lm trims them first), so only the window is compared."""
    if len(bridged) != len(reference):
        raise ValueError(f"bridged cache has {len(bridged)} layers, MLX's own {len(reference)}")
    got, ref = [], []
    for i, (b, r) in enumerate(zip(bridged, reference)):
        bk, bv, bo, keep = _held(b)
        rk, rv, ro, _ = _held(r)
        if bo != ro:
            raise ValueError(f"layer {i}: bridged cache is at offset {bo}, MLX's own at {ro}")
        n = min(bk.shape[2], rk.shape[2])
        if sent_from is not None and int(sent_from[i]) > start:
            n = min(n, bo - int(sent_from[i]))
        bi, ri = _positions(n, bk.shape[2], keep), _positions(n, rk.shape[2], keep)
        got.append({"k": _f32(bk, bi), "v": _f32(bv, bi)})
        ref.append({"k": _f32(rk, ri), "v": _f32(rv, ri)})
    return got, ref


def rope_shift(model):
    """rope(x, layer, d): (H, T, D) keys rotated d positions more by that layer's own RoPE (None: no RoPE found)."""
    ropes = [getattr(getattr(layer, "self_attn", None), "rope", None) for layer in model.layers]
    if any(r is None for r in ropes):
        return None

    def shift(x: np.ndarray, layer: int, d: int) -> np.ndarray:
        flat = mx.array(x.reshape(-1, 1, x.shape[-1]))  # every row its own sequence of one: rotated by d alone
        return np.array(ropes[layer](flat, offset=d).astype(mx.float32)).reshape(x.shape)
    return shift


def compare(bridged: list, reference: list, wire: str = "float32", weights: str = "full", chunk: int | None = None,
            model=None, start: int = 0, band: list[dict] | None = None, sent_from=None) -> dict:
    """The canary's figures (kv_bridge/mlx/fidelity_metric.py): {"layers", "findings", "worst"} over the positions
    both caches hold; `wire` the wire dtype, `weights` the decode model's weight precision, `chunk` the prefill
    step's tokens (one fp8 scale each), `model` for its RoPE (the positions test), `start` the held prefix, `band`
    the pair's calibrated gain band, `sent_from` the received KV's first position per layer (held_pairs)."""
    from kv_bridge.mlx.fidelity_metric import judge

    got, ref = held_pairs(bridged, reference, sent_from, start)
    return judge(got, ref, wire, weights, chunk, rope_shift(model) if model is not None else None, start, band)


def weights_of(path) -> str:
    """The decode model's weight precision for the canary's allowance: "full", or mlx-lm's quantized bits."""
    import json
    from pathlib import Path

    try:
        q = json.loads((Path(path) / "config.json").read_text()).get("quantization") or {}
    except (OSError, ValueError):
        q = {}
    bits = q.get("bits") if isinstance(q, dict) else None
    if not bits:
        return "full"
    return "8" if bits > 4 else "4"


def greedy(model, bridged: list, reference: list, first: int, n: int) -> Generator[None, None, dict]:
    """`n` greedy steps after feeding `first` (the prompt's last token), both caches fed MLX's own greedy tokens
    (teacher-forced, so one divergence does not hide the rest): per step whether the bridged cache's argmax agrees,
    and the KL divergence KL(mlx || bridged) of the next-token distributions. {"agree", "steps", "kl"} (kl: max)."""
    y, agree, kl = first, 0, 0.0
    for _ in range(n):
        ref = model(mx.array([[y]]), cache=reference)[0, -1].astype(mx.float32)
        got = model(mx.array([[y]]), cache=bridged)[0, -1].astype(mx.float32)
        lr, lb = ref - mx.logsumexp(ref), got - mx.logsumexp(got)
        step_kl = mx.sum(mx.exp(lr) * (lr - lb))
        t = int(mx.argmax(ref).item())
        agree += int(mx.argmax(got).item()) == t
        kl = max(kl, float(step_kl.item()))
        y = t
        yield
    return {"agree": agree, "steps": n, "kl": kl}
