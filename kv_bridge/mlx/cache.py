"""Builds mlx-lm prompt caches from received KV (the only mlx code outside backends/).

wire/ReceivedKV (L, H, T, D) per K and V, every layer covering prompt tokens [0, T), in the model's dtype (float32,
float16, or bfloat16 as uint16 bits: viewed as mx.bfloat16, never widened) ->
  full-attention layer:   KVCache holding (1, H, T, D), offset T
  sliding layer (window W, keep k): RotatingKVCache(max_size=W, keep=k) holding the first k and the last
                          W - k tokens in temporal order (all T if T <= W), offset T, _idx = tokens held.
KV for positions [P, T) after a reused prefix cache of P tokens: appended with `append_kv`. A speculative decode
rolls sliding layers back past their window with `RollbackRotatingKVCache` (`rollback_caches`).
The cache class and its max_size/keep come from mlx-lm itself (model.make_cache / make_prompt_cache) and are
cross-checked against the model family (kv_bridge/families/), which says how vLLM ran each layer.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from kv_bridge.families import LayerSpec, family_for


def model_config(model) -> dict:
    """The mlx-lm model's config (its ModelArgs) as a dict, with model_type."""
    cfg = dict(vars(model.args)) if hasattr(model, "args") else {}
    cfg.setdefault("model_type", getattr(model, "model_type", None))
    cfg.setdefault("num_hidden_layers", len(model.layers))
    return cfg


def layer_specs(model) -> list[LayerSpec]:
    """How each layer of `model` attends, per its family; refuses unknown families and divergent configs."""
    cfg = model_config(model)
    family = family_for(cfg["model_type"])
    family.check_config(cfg)
    return family.layer_specs(cfg)


def held_tokens(kv: np.ndarray, max_size: int, keep: int = 0) -> np.ndarray:
    """(H, T, D) -> what a RotatingKVCache(max_size, keep) holds once trimmed: first keep, last max_size - keep."""
    t = kv.shape[1]
    if t <= max_size:
        return kv
    return np.concatenate([kv[:, :keep], kv[:, t - (max_size - keep):]], axis=1)


def rotating_cache(k: mx.array, v: mx.array, offset: int, max_size: int, keep: int = 0) -> RotatingKVCache:
    """RotatingKVCache after a prefill of `offset` tokens, holding k, v (1, H, held, D) = held_tokens(...).

    mlx-lm's one-shot prefill keeps all tokens and trims to the held ones at the next update; holding just those
    from the start (buffer in temporal order, _idx = its length) makes every later update_and_fetch (one token
    or many) leave the same buffer, _idx and offset as mlx-lm's own cache would.
    """
    if k.shape[2] != min(offset, max_size):
        raise ValueError(f"a RotatingKVCache(max_size={max_size}) after {offset} tokens holds "
                         f"{min(offset, max_size)}, got {k.shape[2]}")
    return RotatingKVCache.from_state((k, v, offset, keep, max_size, k.shape[2]))


class RollbackRotatingKVCache(RotatingKVCache):
    """A sliding-window layer's cache that a speculative verify step can roll back past the window.

    mlx-lm's RotatingKVCache trims only while offset < max_size: past it, moving _idx back would leave refused
    tokens in the ring. But a forward over S > 1 tokens (its concat path) keeps max_size - 1 + S positions in
    temporal order, so the S - 1 = k drafted positions are spare beyond the window until the step's outcome is
    known. Trimming n of them here slices them off that ordered buffer (it still holds >= max_size tokens, the
    last max_size of them the window), so the next one-token step overwrites the oldest as mlx-lm's own ring does.
    Attention stays limited to the window: the masks are mlx-lm's own (window_size = the model's sliding window).
    """

    @classmethod
    def of(cls, c: RotatingKVCache) -> "RollbackRotatingKVCache":
        """The same cache, state and all, able to roll back (public state, as mlx-lm saves and loads caches)."""
        return cls.from_state(c.state)

    def is_trimmable(self) -> bool:
        return True

    def rollback_room(self) -> int:
        """How many of the newest tokens can be trimmed now and leave the window whole."""
        if super().is_trimmable() or self.keys is None:
            return self.offset
        return max(0, self._idx - self.max_size if self._idx == self.keys.shape[2] else 0)

    def trim(self, n: int) -> int:
        if super().is_trimmable() or self.keys is None:  # never past the window: mlx-lm's own trim
            return super().trim(n)
        n = min(n, self.rollback_room())
        if n > 0:
            end = self._idx - n  # (1, H, held, D) in temporal order (the concat path's layout): drop the newest n
            self.keys, self.values = self.keys[..., :end, :], self.values[..., :end, :]
            self.offset -= n
            self._idx = end
        return n


def rollback_caches(cache: list) -> list:
    """`cache` with each sliding-window layer able to roll a verify step back (RollbackRotatingKVCache); other
    layers as they are."""
    return [RollbackRotatingKVCache.of(c) if type(c) is RotatingKVCache else c for c in cache]


def _mx(a: np.ndarray, dtype: mx.Dtype | None) -> mx.array:
    """(H, T, D) numpy -> (1, H, T, D) mx in `dtype`; uint16 is bfloat16's bits (kv_bridge/dtypes.py)."""
    x = mx.array(a)[None]
    if a.dtype == np.uint16:
        x = x.view(mx.bfloat16)
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def build_prompt_cache(model, keys: np.ndarray, values: np.ndarray, dtype: mx.Dtype | None = None) -> list:
    """One cache per layer of `model`, of the class mlx-lm makes for it, filled with the given (L, H, T, D) KV."""
    specs = layer_specs(model)
    template = make_prompt_cache(model)
    if not (len(template) == len(specs) == keys.shape[0] == values.shape[0]):
        raise ValueError(f"received KV for {keys.shape[0]} layers, the model has {len(template)}")
    t = keys.shape[2]
    caches = []
    for i, (c, spec) in enumerate(zip(template, specs)):
        if type(c) is KVCache and spec.window is None:
            caches.append(KVCache.from_state((_mx(keys[i], dtype), _mx(values[i], dtype), t)))
        elif type(c) is RotatingKVCache and spec.window == c.max_size and spec.keep == c.keep:
            k, v = (_mx(held_tokens(a[i], c.max_size, c.keep), dtype) for a in (keys, values))
            caches.append(rotating_cache(k, v, t, c.max_size, c.keep))
        else:
            have = type(c).__name__ + (f"(max_size={c.max_size}, keep={c.keep})" if hasattr(c, "max_size") else "")
            raise ValueError(f"layer {i}: mlx-lm makes {have}, but the model family says vLLM ran it with "
                             f"window={spec.window}, keep={spec.keep}; the bridge cannot carry this KV")
    return caches


def plain_caches(keys: np.ndarray, values: np.ndarray, dtype: mx.Dtype | None = None) -> list:
    """A KVCache per layer of received (L, H, T, D) KV (a drafter's own layers: StreamHeader.draft_layers)."""
    t = keys.shape[2]
    return [KVCache.from_state((_mx(keys[i], dtype), _mx(values[i], dtype), t)) for i in range(keys.shape[0])]


def append_kv(cache: list, keys: np.ndarray, values: np.ndarray, dtype: mx.Dtype | None = None) -> list:
    """Extend an mlx-lm cache list (e.g. a reused prefix's) by received (L, H, T, D) KV for the positions after it.

    Goes through each cache's own update_and_fetch, exactly as mlx-lm's chunked prefill extends it, so KVCache,
    RotatingKVCache (which trims to its window) and QuantizedKVCache (which quantizes) all stay consistent.
    """
    if len(cache) != keys.shape[0] or keys.shape != values.shape:
        raise ValueError(f"received KV for {keys.shape[0]} layers, the cache has {len(cache)}")
    for i, c in enumerate(cache):
        c.update_and_fetch(_mx(keys[i], dtype), _mx(values[i], dtype))
    mx.eval([c.state for c in cache])  # materialize now, not inside the first decode step
    return cache


def cache_kv(cache: list, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(L, H, T, D) numpy K and V of the first `num_tokens` positions of an mlx-lm cache list.

    Every layer must hold positions [0, num_tokens) in order: KVCache, or a RotatingKVCache straight after a
    one-shot prefill (mlx-lm trims it only at the next update).
    """
    for i, c in enumerate(cache):
        if isinstance(c, RotatingKVCache) and not (c._idx == c.keys.shape[2] == c.offset >= num_tokens):
            raise ValueError(f"layer {i}: RotatingKVCache no longer holds positions [0, {num_tokens})")
    ks = [np.array(c.keys[0, :, :num_tokens].astype(mx.float32)) for c in cache]
    vs = [np.array(c.values[0, :, :num_tokens].astype(mx.float32)) for c in cache]
    return np.stack(ks), np.stack(vs)


def quantize(cache: list, bits: int | None, group_size: int = 64) -> list:
    """mlx-lm's own post-prefill quantization (what generate_step does with kv_bits): KVCache -> QuantizedKVCache."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    if bits is not None:
        if any(isinstance(c, RotatingKVCache) for c in cache):
            raise ValueError("decode.kv_bits: mlx-lm cannot quantize sliding-window (RotatingKVCache) layers; "
                             "unset decode.kv_bits for this model")
        maybe_quantize_kv_cache(cache, quantized_kv_start=0, kv_group_size=group_size, kv_bits=bits)
    return cache
