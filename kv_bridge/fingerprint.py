"""Model fingerprint: nodes exchange it before any KV so a mismatched model is refused, not decoded.

Hash of the attention geometry, rope parameters and the tokenizer's content, read from an HF or MLX folder. Weight
quantization and dtype are left out (an FP8 Spark and a 4-bit Mac share KV); model_quantization() reports them.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

# rope_* and layer_types/sliding_window decide how keys are rotated and which layers slide (gpt_oss);
# quantization and weight dtype are left out on purpose: an MXFP4 checkpoint, its dequantized twin and an MLX 4-bit
# conversion compute KV of the same shapes and meaning (how close in value: docs/kv_bridge.md, mixed precision).
_FIELDS = ("model_type", "num_hidden_layers", "num_key_value_heads", "num_attention_heads", "head_dim",
           "hidden_size", "rope_theta", "rope_scaling", "rope_parameters", "sliding_window", "layer_types",
           "vocab_size")


def model_geometry(folder: str | Path) -> dict:
    """The config fields that decide KV shapes and values."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    geo = {k: cfg.get(k) for k in _FIELDS}
    if geo["head_dim"] is None and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        geo["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if geo["num_key_value_heads"] is None:
        geo["num_key_value_heads"] = cfg.get("num_attention_heads")
    if geo["rope_theta"] is None:
        geo["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta")
    return geo


@lru_cache(maxsize=16)
def model_fingerprint(folder: str | Path) -> str:
    """Short hex digest identifying the model as far as KV compatibility goes."""
    folder = Path(folder)
    h = hashlib.sha256(json.dumps(model_geometry(folder), sort_keys=True).encode())
    tok = folder / "tokenizer.json"
    if tok.is_file():
        h.update(_tokenizer_digest(tok))
    return h.hexdigest()[:16]


def _tokenizer_digest(path: Path) -> bytes:
    """The tokenizer's content, not its bytes: a converter that re-saves tokenizer.json (mlx-lm does) changes
    whitespace and key order, not the vocabulary, merges, added tokens or normalization."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return hashlib.sha256(path.read_bytes()).digest()
    data.pop("truncation", None)  # runtime settings, not the mapping from text to ids
    data.pop("padding", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=False).encode()).digest()


def model_quantization(folder: str | Path) -> str:
    """How the folder's weights are stored, for /health and `disagg status`: e.g. "mlx 4-bit (group 64)",
    "fp8", "mxfp4", "bfloat16"."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    mlx_q = cfg.get("quantization")
    if isinstance(mlx_q, dict) and mlx_q.get("bits"):
        mode = mlx_q.get("mode", "affine")
        return f"mlx {mlx_q['bits']}-bit" + (f" {mode}" if mode != "affine" else "") + \
            f" (group {mlx_q.get('group_size', 64)})"
    hf_q = cfg.get("quantization_config")
    if isinstance(hf_q, dict):
        method = str(hf_q.get("quant_method", "quantized"))
        fmt = hf_q.get("format") or hf_q.get("quant_algo") or ""  # compressed-tensors / modelopt (NVFP4)
        return method + (f" {fmt}".lower() if fmt else "")
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "unknown")


# HF quantization methods whose weights are fixed-width, and their bits (a config that says its own bits wins).
_HF_BITS = {"fp8": 8, "fbgemm_fp8": 8, "mxfp4": 4, "nvfp4": 4, "awq": 4, "gptq": 4, "bitsandbytes": 4}


def weight_precision(folder: str | Path) -> dict:
    """The weights' quantization, as the fidelity canary's allowance class reads it (kv_bridge/fidelity.py):
    {"scheme": "none" | "fp8" | "mxfp4" | "nvfp4" | "affine" (mlx-lm's) | an HF quant_method, "bits": int | None}.
    Prefill: config.json's `quantization_config` (vLLM's); decode: mlx-lm's `quantization` (bits and mode), else the
    HF one it loaded from (gpt-oss's MXFP4 experts)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    mlx_q = cfg.get("quantization")
    if isinstance(mlx_q, dict) and mlx_q.get("bits"):
        return {"scheme": str(mlx_q.get("mode", "affine")), "bits": int(mlx_q["bits"])}
    hf_q = cfg.get("quantization_config")
    if not isinstance(hf_q, dict):
        return {"scheme": "none", "bits": None}
    scheme = str(hf_q.get("quant_algo") or hf_q.get("quant_method") or "quantized").lower()
    bits = hf_q.get("bits") or hf_q.get("num_bits")
    if hf_q.get("load_in_8bit"):
        bits = 8
    for group in (hf_q.get("config_groups") or {}).values():  # compressed-tensors: the weights' own num_bits
        bits = bits or ((group or {}).get("weights") or {}).get("num_bits")
    return {"scheme": scheme, "bits": int(bits or _HF_BITS.get(scheme, 4))}


def kv_bytes_per_token(folder: str | Path, dtype_bytes: int = 2) -> int:
    """KV bytes one token adds over all layers at `dtype_bytes` per element (2: bf16), windows ignored."""
    geo = model_geometry(folder)
    return 2 * geo["num_hidden_layers"] * geo["num_key_value_heads"] * geo["head_dim"] * dtype_bytes


def config_kv_dtype(folder: str | Path) -> str:
    """The KV dtype a decode node will hold this model's KV in, as config.json predicts it (torch_dtype, or
    transformers' newer `dtype`): what `disagg config check` budgets with. The loaded model is the authority
    (backends/decode/engine.py measures it and warns where this differs); unknown -> float32, the larger."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    return name if name in ("float32", "float16", "bfloat16") else "float32"


def kv_spec(folder: str | Path) -> dict:
    """What a KV stream for this model must declare: fingerprint and shapes."""
    geo = model_geometry(folder)
    return {"fingerprint": model_fingerprint(str(folder)), "num_layers": geo["num_hidden_layers"],
            "num_kv_heads": geo["num_key_value_heads"], "head_dim": geo["head_dim"]}


@lru_cache(maxsize=16)
def drafter_digest(folder: str | Path) -> str:
    """16 hex of sha256 over a learned drafter's config.json and weights (an EAGLE-3 head's folder): a node's KV
    identity carries it, so a changed head re-verifies the pair (its prompt KV rides the model's stream). Once per
    process, as model_fingerprint: a node's identity is asked on every /health until its engine is up, and a
    published head's weights are gigabytes."""
    folder = Path(folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()[:16]


def drafter_layers(folder: str | Path) -> int:
    """The layers a learned drafter adds to the KV stream when a prefill node runs it (StreamHeader.draft_layers):
    its config.json's num_hidden_layers (an EAGLE-3 head 1, a DFlash drafter its own)."""
    return int(json.loads((Path(folder) / "config.json").read_text()).get("num_hidden_layers", 1))
