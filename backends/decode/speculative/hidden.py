"""The target's forward with its hidden states: learned drafters (EAGLE-3, DFlash) read the residual stream at a few
of the target's layers. A wrapper over mlx-lm's model runs its public modules (embed_tokens, layers, norm, lm_head)
itself, per family as mlx-lm builds the masks, and hands the chosen layers' states to whoever listens on a cache.
"""

from __future__ import annotations

from typing import Callable


def _full(inner, cache, h):
    from mlx_lm.models.base import create_attention_mask

    mask = create_attention_mask(h, cache[0])
    return [mask] * len(inner.layers)


def _llama(inner, cache, h):
    """mlx-lm's llama: full layers and, where layer_types says so, sliding ones (one mask per kind)."""
    from mlx_lm.models.base import create_attention_mask

    full = create_attention_mask(h, cache[inner.fa_idx])
    if inner.swa_idx is None:
        return [full] * len(inner.layers)
    swa = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.sliding_window)
    return [swa if layer.use_sliding else full for layer in inner.layers]


def _gpt_oss(inner, cache, h):
    """gpt-oss: alternating sliding-window and full attention (mlx-lm's GptOssMoeModel)."""
    from mlx_lm.models.base import create_attention_mask

    full = create_attention_mask(h, cache[inner.ga_idx])
    swa = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.window_size)
    return [full if t == "full_attention" else swa for t in inner.layer_types]


# model_type -> the per-layer masks its mlx-lm model builds (a family not here: ValueError naming it)
MASKS: dict[str, Callable] = {"llama": _llama, "qwen3": _full, "qwen3_moe": _full, "qwen2": _full, "gpt_oss": _gpt_oss}


def target_args(model) -> dict:
    """What a drafter is checked against: the target's hidden size, logits width, layers and RoPE."""
    a = model.args
    return {"model_type": a.model_type, "hidden_size": a.hidden_size, "vocab_size": a.vocab_size,
            "num_hidden_layers": a.num_hidden_layers, "rope_theta": float(getattr(a, "rope_theta", 10000.0)),
            "rope_scaling": getattr(a, "rope_scaling", None),
            "max_position_embeddings": getattr(a, "max_position_embeddings", None)}


class HiddenTap:
    """Wraps an mlx-lm model: called as the model is (`model(inputs, cache=cache)`), it returns the same logits. A
    forward over a cache someone listens on (`listen(cache, fn)`) runs the layers here and calls
    fn(start, hidden): `start` the cache offset before the forward, `hidden` (1, L, len(points) * hidden_size), the
    concatenated states at `points` (HF's hidden_states indices: 0 the embeddings, i the output of layer i - 1).
    Every other forward (the batch, canaries) is the model's own call. Other attributes are the model's."""

    def __init__(self, model, points: list[int]) -> None:
        mt = model.args.model_type
        if mt not in MASKS:
            raise ValueError(f"learned drafters cannot read hidden states of a {mt!r} model yet (known: "
                             f"{sorted(MASKS)}): use method = \"prompt_lookup\" or \"draft\"")
        n = model.args.num_hidden_layers
        bad = [p for p in points if not 0 <= p <= n]
        if bad:
            raise ValueError(f"hidden-state layers {bad} outside the model's 0..{n}")
        self.model, self.points, self._masks = model, list(points), MASKS[mt]
        self._listeners: dict[int, Callable] = {}

    def __getattr__(self, name):  # only called for what this wrapper lacks: layers, args, make_cache, ...
        return getattr(self.model, name)

    def listen(self, cache: list, fn: Callable | None) -> None:
        """fn(start, hidden) after every forward over `cache` (None: stop)."""
        if fn is None:
            self._listeners.pop(id(cache), None)
        else:
            self._listeners[id(cache)] = fn

    def __call__(self, inputs, cache=None, **kw):
        fn = self._listeners.get(id(cache)) if cache is not None else None
        if fn is None or kw:
            return self.model(inputs, cache=cache, **kw)
        start = cache[0].offset
        logits, hidden = self.forward(inputs, cache)
        fn(start, hidden)
        return logits

    def forward(self, inputs, cache):
        """(logits, hidden): the model's own computation, layer by layer, keeping the states at `points`."""
        import mlx.core as mx

        inner = self.model.model
        h = inner.embed_tokens(inputs)
        keep = {p: None for p in self.points}
        masks = self._masks(inner, cache, h)
        for i, (layer, c, mask) in enumerate(zip(inner.layers, cache, masks)):
            if i in keep:
                keep[i] = h
            h = layer(h, mask, c)
        if len(inner.layers) in keep:
            keep[len(inner.layers)] = h
        return self.logits(inner.norm(h)), mx.concatenate([keep[p] for p in self.points], axis=-1)

    def logits(self, normed):
        m = self.model
        return m.lm_head(normed) if hasattr(m, "lm_head") else m.model.embed_tokens.as_linear(normed)

    def embed(self, tokens):
        return self.model.model.embed_tokens(tokens)
