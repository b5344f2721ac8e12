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

CHUNK = 32  # tokens of MLX's own prefill per step of the MLX thread (~2 s on mlx-cpu here, ~10 ms on a Mac)


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


def compare(bridged: list, reference: list) -> list[dict]:
    """Per layer, the relative error max |bridged - reference| / max |reference| of K and V over the positions both
    caches hold: [{"layer", "k", "v", "tokens"}]."""
    if len(bridged) != len(reference):
        raise ValueError(f"bridged cache has {len(bridged)} layers, MLX's own {len(reference)}")
    out = []
    for i, (b, r) in enumerate(zip(bridged, reference)):
        bk, bv, bo, keep = _held(b)
        rk, rv, ro, _ = _held(r)
        if bo != ro:
            raise ValueError(f"layer {i}: bridged cache is at offset {bo}, MLX's own at {ro}")
        n = min(bk.shape[2], rk.shape[2])
        bi, ri = _positions(n, bk.shape[2], keep), _positions(n, rk.shape[2], keep)
        errs = {}
        for name, x, y in (("k", bk, rk), ("v", bv, rv)):
            got, ref = _f32(x, bi), _f32(y, ri)
            errs[name] = float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
        out.append({"layer": i, **errs, "tokens": int(n)})
    return out


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
