"""EAGLE-3 heads in MLX, loaded as vLLM loads them (vllm/model_executor/models/llama_eagle3.py): fc fuses the
target's auxiliary hidden states (3 layers) into one, one llama decoder layer attends over [embedding, fused state]
(2x hidden), a draft vocabulary maps back to the target's through d2t; embeddings: the target's unless it has its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from backends.decode.speculative.learned import check_rope, check_target


@dataclass
class Eagle3Config:
    """The fields vLLM and SpecForge read from a head's config.json (NVIDIA's and SpecForge's heads write the same
    llama fields plus eagle_config.eagle_aux_hidden_state_layer_ids, draft_vocab_size, target_hidden_size)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] | None  # None: vLLM's default for the target (2, L // 2, L - 3)
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int | None
    attention_bias: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False

    @classmethod
    def from_dict(cls, cfg: dict) -> "Eagle3Config":
        arch = (cfg.get("architectures") or ["?"])[0]
        if "eagle3" not in arch.lower() and cfg.get("speculators_model_type") != "eagle3":
            raise ValueError(f"not an EAGLE-3 head: architectures {arch!r} (expected LlamaForCausalLMEagle3)")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE-3 head with num_hidden_layers {cfg['num_hidden_layers']}: only one-layer heads "
                             "(as published for the site models) are supported")
        if cfg.get("fc_norm") or cfg.get("parallel_drafting"):
            raise ValueError("EAGLE-3 head variants with fc_norm / parallel_drafting are not supported")
        eagle = cfg.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError("eagle_config.use_aux_hidden_state is false: that is an EAGLE-1 head, not EAGLE-3")
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        return cls(hidden_size=hidden, intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
                   num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or hidden // heads, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                   vocab_size=cfg["vocab_size"], draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
                   target_hidden_size=cfg.get("target_hidden_size") or hidden,
                   aux_layer_ids=eagle.get("eagle_aux_hidden_state_layer_ids",
                                           cfg.get("eagle_aux_hidden_state_layer_ids")),
                   rope_theta=float(cfg.get("rope_theta", 10000.0)),  # LlamaConfig's default, as vLLM reads it
                   rope_scaling=cfg.get("rope_scaling"),
                   max_position_embeddings=cfg.get("max_position_embeddings"),
                   attention_bias=bool(cfg.get("attention_bias", False)),
                   norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                   norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))))

    def aux_layers(self, target: dict) -> list[int]:
        """The target layers whose input the head reads (vLLM's numbering: 0 is the embeddings)."""
        n = target["num_hidden_layers"]
        return list(self.aux_layer_ids) if self.aux_layer_ids else [2, n // 2, n - 3]

    def check(self, target: dict, own_embed: bool, path: str = "the head") -> None:
        """ValueError naming the field where the head was not trained for this target."""
        check_target(path, "target_hidden_size", self.target_hidden_size, target["hidden_size"])
        check_target(path, "vocab_size", self.vocab_size, target["vocab_size"])
        if not own_embed:  # the target's embeddings feed the head's first half of [embedding, fused]
            check_target(path, "hidden_size", self.hidden_size, target["hidden_size"])
        check_rope(path, self.rope_theta, self.rope_scaling, target)
        n = target["num_hidden_layers"]
        bad = [i for i in self.aux_layers(target) if not 0 <= i < n]
        if bad:
            raise ValueError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids {bad} outside the target's "
                             f"{n} layers: the head was trained for another model")

    def llama_args(self) -> llama.ModelArgs:
        return llama.ModelArgs(model_type="llama", hidden_size=self.hidden_size, num_hidden_layers=1,
                               intermediate_size=self.intermediate_size, num_attention_heads=self.num_attention_heads,
                               rms_norm_eps=self.rms_norm_eps, vocab_size=self.vocab_size, head_dim=self.head_dim,
                               max_position_embeddings=self.max_position_embeddings,
                               num_key_value_heads=self.num_key_value_heads, attention_bias=self.attention_bias,
                               rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, tie_word_embeddings=False)


class MidLayer(nn.Module):
    """vLLM's Eagle3 LlamaDecoderLayer (layer 0): q/k/v read [input_layernorm(embedding), hidden_norm(fused)]."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        args = cfg.llama_args()
        self.self_attn = llama.Attention(args)
        h, hd, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.self_attn.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * hd, bias=b)
        self.self_attn.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=b)
        self.self_attn.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=b)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual

    def __call__(self, emb, hidden, mask, cache):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(emb), normed], axis=-1)
        residual = residual + self.self_attn(x, mask, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))  # the pre-norm output, fed back


class Eagle3Head(nn.Module):
    """Weights named as published (fc, midlayer.*, norm, lm_head, d2t; embed_tokens only if the head has its own)."""

    def __init__(self, cfg: Eagle3Config, own_embed: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        fused = (len(cfg.aux_layer_ids) if cfg.aux_layer_ids else 3) * cfg.target_hidden_size
        if cfg.norm_before_fc:
            self.input_norm = nn.RMSNorm(fused, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(fused, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if own_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # d2t[i]: target id of draft id i minus i (zeros when the vocabularies are the same)
        self.d2t = mx.zeros((cfg.draft_vocab_size,), dtype=mx.int32)

    def fuse(self, aux):
        """(1, L, n_aux * target_hidden) -> (1, L, hidden)."""
        return self.fc(self.input_norm(aux) if "input_norm" in self else aux)

    def __call__(self, emb, hidden, cache: list | None):
        """cache: [KVCache] (None: no cache). emb (1, L, H) of tokens x[i+1], hidden (1, L, H) fused states g[i] (or
        the head's own output): (pre-norm output (1, L, H), draft logits (1, L, draft_vocab)) predicting x[i+2]."""
        c = cache[0] if cache else None
        out = self.midlayer(emb, hidden, create_attention_mask(emb, c), c)
        return out, self.lm_head(self.norm(out))

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


def _rename(name: str) -> str | None:
    """Published names -> ours: vLLM maps midlayer. to layers.0., ModelOpt/speculators exports use layers.0."""
    name = name.removeprefix("model.")
    if name.startswith("t2d"):
        return None  # the target -> draft mask: vLLM skips it too
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def load_eagle3(path: str, target: dict) -> Eagle3Head:
    """The head in folder `path` (config.json + *.safetensors), checked against the target (ValueError naming the
    field that does not match)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"speculative.draft_path {path}: no config.json (an EAGLE-3 head's folder)")
    cfg = Eagle3Config.from_dict(json.loads((folder / "config.json").read_text()))
    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    weights = {n: w for n, w in ((_rename(k), v) for k, v in weights.items()) if n is not None}
    own_embed = "embed_tokens.weight" in weights
    cfg.check(target, own_embed, str(path))
    head = Eagle3Head(cfg, own_embed)
    if "d2t" not in weights and cfg.draft_vocab_size != cfg.vocab_size:
        raise ValueError(f"{path}: draft_vocab_size {cfg.draft_vocab_size} < vocab_size {cfg.vocab_size} but no "
                         "d2t tensor: the head's weights are incomplete")
    weights["d2t"] = weights.get("d2t", head.d2t).astype(mx.int32)
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())
    return head


def save_eagle3(head: Eagle3Head, config: dict, path: str) -> str:
    """Write a head as SpecForge publishes one (config.json, model.safetensors with midlayer.* names)."""
    from mlx.utils import tree_flatten

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    # vLLM reads the dtype from config.json, else from the safetensors metadata (a null one stops its start)
    config = {**config, "torch_dtype": str(head.fc.weight.dtype).removeprefix("mlx.core.")}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    weights = dict(tree_flatten(head.parameters()))
    # One vocabulary: no d2t (vLLM's head has no such parameter to load it into, and its start fails on it)
    if (config.get("draft_vocab_size") or config["vocab_size"]) == config["vocab_size"]:
        weights.pop("d2t", None)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return str(folder)


def head_config(target: dict, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                draft_vocab: int | None = None) -> dict:
    """config.json for a new head over `target` (hidden.target_args), in SpecForge's field names."""
    n = target["num_hidden_layers"]
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": target["hidden_size"], "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
            "vocab_size": target["vocab_size"], "draft_vocab_size": draft_vocab or target["vocab_size"],
            "target_hidden_size": target["hidden_size"], "rope_theta": target["rope_theta"],
            "rope_scaling": target["rope_scaling"], "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3], "use_aux_hidden_state": True},
            # the target's: vLLM runs a head only over sequences within its max_model_len, which it derives from
            # this (LlamaConfig's default, 2048, where absent: a longer prompt would carry no head KV)
            **({"max_position_embeddings": target["max_position_embeddings"]}
               if target.get("max_position_embeddings") else {})}


def untrained_eagle3(target: dict, path: str, seed: int = 0, draft_ids: list[int] | None = None,
                     attention: tuple[int, int, int] = (2, 1, 32)) -> str:
    """A small random head for `target` (tests: only losslessness depends on a head, never its quality). With
    `draft_ids`, a draft vocabulary of those target ids and its d2t; `attention`: (heads, KV heads, head_dim)."""
    mx.random.seed(seed)
    heads, kv_heads, head_dim = attention
    cfg = head_config(target, heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=64,
                      draft_vocab=len(draft_ids) if draft_ids else None)
    head = Eagle3Head(Eagle3Config.from_dict(cfg))
    if draft_ids:
        head.d2t = mx.array(draft_ids, dtype=mx.int32) - mx.arange(len(draft_ids), dtype=mx.int32)
    return save_eagle3(head, cfg, path)
