"""The EAGLE-3 head (or DFlash drafter) a prefill node runs over each prompt (vLLM's own proposer,
`speculative_config`), so its prompt KV rides the KV stream as more layers for the decode node's drafter
(docs/speculative.md). Checked at start
from config files alone (a prefill node has no MLX): the fix is in each message.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

from kv_bridge.config.models import ModelRoute, resolve_model_path

_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
LLAMA_DEFAULT_POSITIONS = 2048  # transformers' LlamaConfig.max_position_embeddings, which vLLM reads for a head
log = logging.getLogger("backends.prefill.node")


def speculative_config(route: ModelRoute, model_folder: Path) -> dict | None:
    """vLLM's speculative_config for the route's prefill_draft_path (None: no head): one speculative token, the
    least vLLM accepts; the prefill node generates one token, so the head's prefill over the prompt is what runs."""
    if not route.prefill_draft_path:
        return None
    folder = resolve_model_path(route, role="prefill_draft")
    cfg = check_head(folder, model_folder)
    reach = cfg.get("max_position_embeddings") or LLAMA_DEFAULT_POSITIONS
    if reach < route.max_model_len:
        log.warning("%s: prefill_draft_path %s: the head's max_position_embeddings is %d (%s), under max_model_len "
                    "%d: vLLM runs the head only over prompts within it, so longer prompts carry no head KV (their "
                    "model KV is unaffected; the decode node's head starts from its own forwards). Set the head's "
                    "max_position_embeddings to the model's if its RoPE holds that far", route.id, folder, reach,
                    "config.json" if cfg.get("max_position_embeddings") else "LlamaConfig's default: none given",
                    route.max_model_len)
    return {"method": method(cfg), "model": str(folder), "num_speculative_tokens": 1}


def method(cfg: dict) -> str:
    """vLLM's speculative_config method for a drafter's config.json: "dflash" for a DFlash drafter, else "eagle3"."""
    return "dflash" if (cfg.get("architectures") or [""])[0] == "DFlashDraftModel" else "eagle3"


def check_head(folder: Path, model_folder: Path) -> dict:
    """ValueError naming the field where the head cannot run on the prefill node or its KV cannot share the
    model's stream (same KV heads and head_dim: true of both site heads); the head's config.json otherwise."""
    where = f"prefill_draft_path {folder}"
    try:
        cfg = json.loads((folder / "config.json").read_text())
        target = json.loads((model_folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read the head's or the model's config.json ({e}): fetch the head with "
                         "`disagg models prepare --model ID --role draft`, or unset prefill_draft_path") from None
    target = target.get("text_config", target)
    arch = (cfg.get("architectures") or ["?"])[0]
    if "eagle3" not in arch.lower() and arch != "DFlashDraftModel":
        raise ValueError(f"{where}: architectures {arch!r} is neither an EAGLE-3 head (LlamaForCausalLMEagle3) nor a "
                         "DFlash drafter (DFlashDraftModel); only their prompt KV is bridged")
    mine = (cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    theirs = (target.get("num_key_value_heads") or target["num_attention_heads"],
              target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"])
    if mine != theirs:
        raise ValueError(f"{where}: the head's KV (num_key_value_heads, head_dim) {mine} differs from the model's "
                         f"{theirs}: its KV cannot ride the model's stream; unset prefill_draft_path (the decode "
                         "node's head then starts from its own forwards)")
    if not (cfg.get("torch_dtype") or cfg.get("dtype")) and _null_metadata(folder):
        raise ValueError(f"{where}: config.json names no torch_dtype and the safetensors carry no metadata, which "
                         "vLLM 0.32 cannot read (model_arch_config_convertor.get_torch_dtype); add \"torch_dtype\" "
                         f"({_weights_dtype(folder)}) to the head's config.json")
    return cfg


def _headers(folder: Path) -> list[dict]:
    out = []
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            out.append(json.loads(fh.read(n)))
    if not out:
        raise ValueError(f"prefill_draft_path {folder}: no *.safetensors")
    return out


def _null_metadata(folder: Path) -> bool:
    return any("__metadata__" in h and h["__metadata__"] is None for h in _headers(folder))


def _weights_dtype(folder: Path) -> str:
    kinds = {v["dtype"] for h in _headers(folder) for k, v in h.items() if k != "__metadata__" and k != "d2t"}
    return "/".join(sorted(_DTYPES.get(k, k) for k in kinds))
