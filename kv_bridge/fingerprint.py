"""Model fingerprint: nodes exchange it before any KV so a mismatched model is refused, not decoded.

Hash of the attention geometry, rope parameters, weight dtype and the tokenizer file, read from the HF folder.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

# rope_* and layer_types/sliding_window decide how keys are rotated and which layers slide (gpt_oss);
# quantization is left out on purpose: an MXFP4 checkpoint and its dequantized twin compute the same KV.
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
    geo["dtype"] = cfg.get("torch_dtype") or cfg.get("dtype")
    return geo


@lru_cache(maxsize=16)
def model_fingerprint(folder: str | Path) -> str:
    """Short hex digest identifying the model as far as KV compatibility goes."""
    folder = Path(folder)
    h = hashlib.sha256(json.dumps(model_geometry(folder), sort_keys=True).encode())
    tok = folder / "tokenizer.json"
    if tok.is_file():
        h.update(hashlib.sha256(tok.read_bytes()).digest())
    return h.hexdigest()[:16]


def kv_spec(folder: str | Path) -> dict:
    """What a KV stream for this model must declare: fingerprint and shapes."""
    geo = model_geometry(folder)
    return {"fingerprint": model_fingerprint(str(folder)), "num_layers": geo["num_hidden_layers"],
            "num_kv_heads": geo["num_key_value_heads"], "head_dim": geo["head_dim"]}
