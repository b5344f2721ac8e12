"""DFlash block drafters in MLX, loaded as z-lab's published code loads them (dflash/model.py, DFlashDraftModel): fc
fuses the outputs of the target layers dflash_config.target_layer_ids into a context whose keys and values every
drafter layer caches; a block [last token, mask x (block_size - 1)] attends to it and to itself (not causally), and
the target's own embeddings and lm_head turn it into block_size - 1 drafts in one forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from backends.decode.speculative.learned import HiddenSource, check_rope, check_target


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's build_target_layer_ids: evenly from layer 1 to layer L - 3 (one drafter layer: the middle one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int | None
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, cfg: dict) -> "DFlashConfig":
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch != "DFlashDraftModel":
            raise ValueError(f"not a DFlash drafter: architectures {arch!r} (expected DFlashDraftModel)")
        types = set(cfg.get("layer_types") or ["full_attention"])
        if types != {"full_attention"}:
            raise ValueError(f"DFlash drafter with layer_types {sorted(types)}: only full-attention drafter layers "
                             "are supported")
        d = cfg.get("dflash_config") or {}
        n_draft, n_target = cfg["num_hidden_layers"], cfg["num_target_layers"]
        heads = cfg["num_attention_heads"]
        return cls(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                   num_hidden_layers=n_draft, num_attention_heads=heads,
                   num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), vocab_size=cfg["vocab_size"],
                   num_target_layers=n_target,
                   target_layer_ids=list(d.get("target_layer_ids") or default_layer_ids(n_target, n_draft)),
                   block_size=int(d.get("block_size", cfg.get("block_size", 16))),
                   mask_token_id=int(d["mask_token_id"] if "mask_token_id" in d else cfg["mask_token_id"]),
                   rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=cfg.get("rope_scaling"),
                   max_position_embeddings=cfg.get("max_position_embeddings"),
                   attention_bias=bool(cfg.get("attention_bias", False)))

    def check(self, target: dict, path: str = "the drafter") -> None:
        """ValueError naming the field where the drafter was not trained for this target."""
        check_target(path, "hidden_size", self.hidden_size, target["hidden_size"])
        check_target(path, "vocab_size", self.vocab_size, target["vocab_size"])
        check_target(path, "num_target_layers", self.num_target_layers, target["num_hidden_layers"])
        check_rope(path, self.rope_theta, self.rope_scaling, target)
        bad = [i for i in self.target_layer_ids if not 0 <= i < target["num_hidden_layers"]]
        if bad:
            raise ValueError(f"{path}: dflash_config.target_layer_ids {bad} outside the target's "
                             f"{target['num_hidden_layers']} layers")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"{path}: dflash_config.mask_token_id {self.mask_token_id} outside the vocabulary")
        if self.block_size < 2:
            raise ValueError(f"{path}: block_size {self.block_size}: a block drafts block_size - 1 tokens")


class Attention(nn.Module):
    """Qwen3 attention (q/k RMSNorm per head); keys and values of the context are cached, the block's are not."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, hd, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv_heads, self.scale = cfg.num_attention_heads, cfg.num_key_value_heads, hd ** -0.5
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=b)
        self.k_proj = nn.Linear(h, self.n_kv_heads * hd, bias=b)
        self.v_proj = nn.Linear(h, self.n_kv_heads * hd, bias=b)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=b)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(hd, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings)

    def _kv(self, x, offset: int):
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def add_context(self, ctx, cache) -> None:
        """ctx (1, S, H): the fused target states of the next S positions, into the cache."""
        cache.update_and_fetch(*self._kv(ctx, cache.offset))

    def __call__(self, x, cache):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=cache.offset)
        k, v = self._kv(x, cache.offset)
        if cache.offset:
            n = cache.offset
            k = mx.concatenate([cache.keys[..., :n, :], k], axis=2)
            v = mx.concatenate([cache.values[..., :n, :], v], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=None)  # the block sees itself whole
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg)
        self.mlp = _MLP(h, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)

    def __call__(self, x, cache):
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDrafter(nn.Module):
    """Weights named as published: fc, hidden_norm, layers.N.*, norm (embeddings and lm_head: the target's)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [Layer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def add_context(self, aux, cache: list) -> None:
        ctx = self.hidden_norm(self.fc(aux))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.add_context(ctx, c)

    def __call__(self, block_emb, cache: list):
        h = block_emb
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)


def load_dflash(path: str, target: dict) -> DFlashDrafter:
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"speculative.draft_path {path}: no config.json (a DFlash drafter's folder)")
    cfg = DFlashConfig.from_dict(json.loads((folder / "config.json").read_text()))
    cfg.check(target, str(path))
    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    drafter = DFlashDrafter(cfg)
    drafter.load_weights([(k.removeprefix("model."), v) for k, v in weights.items()], strict=True)
    mx.eval(drafter.parameters())
    return drafter


def untrained_dflash(target: dict, path: str, layers: int = 2, block_size: int = 8, seed: int = 0,
                     mask_token_id: int = 0, attention: tuple[int, int, int] = (2, 1, 32),
                     layer_ids: list[int] | None = None) -> str:
    """A small random drafter for `target` in z-lab's config fields (tests: losslessness, never quality).
    `attention`: (heads, KV heads, head_dim) (the model's, for a drafter whose KV rides the model's stream);
    `layer_ids`: the target layers it reads (default: z-lab's picks). vLLM reads the dtype from config.json."""
    from mlx.utils import tree_flatten

    n = target["num_hidden_layers"]
    heads, kv_heads, head_dim = attention
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": target["hidden_size"],
           "intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
           "vocab_size": target["vocab_size"], "num_target_layers": n, "block_size": block_size,
           "rope_theta": target["rope_theta"], "rope_scaling": target["rope_scaling"], "torch_dtype": "float32",
           **({"max_position_embeddings": target["max_position_embeddings"]}
              if target.get("max_position_embeddings") else {}),
           "dflash_config": {"target_layer_ids": layer_ids or default_layer_ids(n, layers),
                             "mask_token_id": mask_token_id}}
    mx.random.seed(seed)
    drafter = DFlashDrafter(DFlashConfig.from_dict(cfg))
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(drafter.parameters())),
                        metadata={"format": "mlx"})
    return str(folder)


class DFlashSource(HiddenSource):
    """One generation's block drafts: the drafter's cache holds context for every target position whose state
    arrived (verified ones only: rows above the target cache's offset are never consumed); a draft is one forward of
    [seq[-1], mask...] at the next position, its rows after the first being the drafts."""

    name = "dflash"

    def __init__(self, drafter: DFlashDrafter, tap, seq: list[int], target_cache: list) -> None:
        from mlx_lm.models.cache import KVCache

        super().__init__(tap, seq, target_cache)
        self.drafter = drafter
        self.cache = [KVCache() for _ in drafter.layers]

    def install_prompt_kv(self, start: int, keys, values) -> bool:
        """The drafter's context KV of prompt positions [start, start + T), every layer, as the prefill node's DFlash
        drafter computed it ((Ld, H, T, D) numpy), before any state arrived; False otherwise. From `start` > 0 (a
        prefix the Mac held) its keys turned back by `start` positions (HiddenSource._install)."""
        cfg = self.drafter.cfg
        if start < 0 or self.next is not None or self.cache[0].offset != 0:
            return False
        if keys.shape[0] != cfg.num_hidden_layers or keys.shape[1::2] != (cfg.num_key_value_heads, cfg.head_dim):
            raise ValueError(f"the prefill node's DFlash KV has (layers, heads, head_dim) "
                             f"{(keys.shape[0], *keys.shape[1::2])}, this node's drafter "
                             f"{(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)}: the two sides run "
                             "different drafters")
        self.cache = self._install(start, keys, values, self.drafter.fc.weight.dtype,
                                   [layer.self_attn.rope for layer in self.drafter.layers])
        return True

    def _consume(self, most: int | None = None) -> bool:
        got = self._take(len(self.seq) - 1, most)
        if got is None:
            return False
        self.drafter.add_context(got[1], self.cache)
        return True

    def prefill_step(self) -> bool:
        if self._usable(len(self.seq) - 1) <= self.PREFILL_CHUNK:
            return False
        self._consume(self.PREFILL_CHUNK)
        mx.eval([c.keys for c in self.cache])
        return True

    def draft(self, k: int) -> list[int]:
        if k <= 0:
            return []
        self._consume()
        if self.next != len(self.seq) - 1:  # no context for the text so far (yet)
            return []
        n = min(k, self.drafter.cfg.block_size - 1)
        block = mx.array([[self.seq[-1]] + [self.drafter.cfg.mask_token_id] * n])
        logits = self.tap.logits(self.drafter(self.tap.embed(block), self.cache)[:, 1:])
        drafts = mx.argmax(logits[0], axis=-1).tolist()
        return drafts

    def accepted(self, kept: int) -> None:
        """Nothing to rewind: the block was never cached; the kept tokens' states come with the next forward."""

    def close(self) -> None:
        super().close()
        self.cache = None


def dflash_prompt_kv(drafter: DFlashDrafter, tap, ids: list[int]):
    """The drafter's context KV of a prompt as this node computes it: the target over ids[:-1], its states at the
    drafter's layers into the drafter's context. (K, V) float32 numpy (Ld, H, T, D): the reference the prefill node's
    DFlash KV is checked against (the same positions, the same RoPE)."""
    import numpy as np
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache, got = make_prompt_cache(tap.model), []
    tap.listen(cache, lambda start, hidden: got.append(hidden))
    try:
        tap(mx.array([ids[:-1]]), cache=cache)
    finally:
        tap.listen(cache, None)
    own = [KVCache() for _ in drafter.layers]
    drafter.add_context(got[0], own)
    n = len(ids) - 1
    return tuple(np.stack([np.array(getattr(c, a)[0, :, :n].astype(mx.float32)) for c in own])
                 for a in ("keys", "values"))
