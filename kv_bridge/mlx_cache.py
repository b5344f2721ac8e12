"""Builds mlx-lm prompt caches from received KV (the only mlx code outside backends/).

wire/ReceivedKV (L, H, T, D) per K and V -> per layer mlx-lm KVCache holding (1, H, T, D), offset T.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache


def build_prompt_cache(model, keys: np.ndarray, values: np.ndarray, dtype: mx.Dtype | None = None) -> list:
    """One cache per layer of `model`, as make_prompt_cache would make them, filled with the given KV."""
    template = make_prompt_cache(model)
    if len(template) != keys.shape[0]:
        raise ValueError(f"received KV for {keys.shape[0]} layers, the model has {len(template)}")
    caches = []
    for i, c in enumerate(template):
        if type(c) is not KVCache:
            raise ValueError(f"layer {i} uses {type(c).__name__}; the bridge builds KVCache only for now")
        k, v = mx.array(keys[i])[None], mx.array(values[i])[None]
        if dtype is not None:
            k, v = k.astype(dtype), v.astype(dtype)
        caches.append(KVCache.from_state((k, v, k.shape[2])))
    return caches


def cache_kv(cache: list, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(L, H, T, D) numpy K and V of the first `num_tokens` positions of an mlx-lm KVCache list."""
    ks = [np.array(c.keys[0, :, :num_tokens].astype(mx.float32)) for c in cache]
    vs = [np.array(c.values[0, :, :num_tokens].astype(mx.float32)) for c in cache]
    return np.stack(ks), np.stack(vs)
