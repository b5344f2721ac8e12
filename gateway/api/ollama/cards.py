"""What Ollama's model endpoints report for each configured model (size, digest, details, model_info, template),
read from its folder at start-up: no weights are read, only file sizes, config.json and safetensors headers."""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aiohttp import web

from kv_bridge.config.models import ModelRoute, resolve_model_path

_MAX_HEADER_BYTES = 100 << 20  # a safetensors JSON header larger than this is not a model we made
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".npz")




@dataclass(frozen=True)
class ModelCard:
    """What Ollama's model endpoints report for one configured model, read from its folder at start-up."""

    id: str
    folder: Path
    size: int
    digest: str
    modified_at: str
    details: dict
    model_info: dict
    template: str
    vocab_size: int | None


CARDS = web.AppKey("disagg_ollama_cards", dict)


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _human_number(n: int) -> str:
    """Ollama's parameter_size style: 134.52M, 7.6B, 8B."""
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2), ("K", 1e3, 0)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f}{unit}" if x == int(x) else f"{x:.{digits}f}{unit}"
    return str(n)


def _safetensors_params(folder: Path) -> tuple[int, str]:
    """(parameter count, the dtype most parameters have) from the safetensors headers; no weights are read."""
    total, by_dtype = 0, {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n)) if n <= _MAX_HEADER_BYTES else {}
        except (OSError, ValueError, struct.error):
            continue
        for name, t in header.items():
            if name != "__metadata__" and isinstance(t, dict):
                count = math.prod(t.get("shape") or [])
                total += count
                by_dtype[t.get("dtype", "")] = by_dtype.get(t.get("dtype", ""), 0) + count
    return total, max(by_dtype, key=by_dtype.get, default="")


def _template_text(folder: Path) -> str:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tpl = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) else ""


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _model_info(cfg: dict, params: int) -> dict:
    """Ollama's GGUF-style keys, from the HF config.json."""
    arch = str(cfg.get("model_type") or "unknown")
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    keys = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
            "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
            "attention.key_length": "head_dim", "attention.value_length": "head_dim",
            "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
            "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"}
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": params}
    info.update({f"{arch}.{k}": cfg[src] for k, src in keys.items() if cfg.get(src) is not None})
    if rope is not None:
        info[f"{arch}.rope.freq_base"] = rope
    return info


def build_card(route: ModelRoute) -> ModelCard:
    folder = resolve_model_path(route)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    cfg = _read_json(folder / "config.json")
    params, dtype = _safetensors_params(folder)
    # Identity of the weights without hashing gigabytes: config.json plus each weight file's name and size.
    h = hashlib.sha256((folder / "config.json").read_bytes() if (folder / "config.json").is_file() else b"")
    for p in files:
        if p.suffix in _WEIGHT_SUFFIXES:
            h.update(f"\n{p.relative_to(folder)}:{p.stat().st_size}".encode())
    quant = cfg.get("quantization_config") or cfg.get("quantization") or {}
    if quant:
        level = str(quant.get("quant_method") or f"Q{quant.get('bits', '')}").upper()
    else:
        level = dtype.upper()
    family = str(cfg.get("model_type") or "unknown")
    details = {"parent_model": "", "format": "safetensors", "family": family, "families": [family],
               "parameter_size": _human_number(params), "quantization_level": level}
    return ModelCard(
        id=route.id, folder=folder, size=sum(p.stat().st_size for p in files), digest=h.hexdigest(),
        modified_at=_rfc3339(max((p.stat().st_mtime for p in files), default=time.time())), details=details,
        model_info=_model_info(cfg, params), template=_template_text(folder), vocab_size=cfg.get("vocab_size"),
    )
