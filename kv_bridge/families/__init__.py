"""Model families, one file each, chosen by the HF `model_type` (never guessed): the KV bridge's quirks and the
output formats (reasoning, tool calls) the gateway parses by default."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from kv_bridge.families.base import Family, FamilyConfigError, LayerSpec
from kv_bridge.families.gpt_oss import GptOss
from kv_bridge.families.llama import Llama
from kv_bridge.families.qwen2 import Qwen2
from kv_bridge.families.qwen3 import Qwen3
from kv_bridge.families.qwen3_moe import Qwen3Moe

# HF config.json `model_type` -> family
FAMILIES: dict[str, Family] = {
    "llama": Llama(),
    "qwen3_moe": Qwen3Moe(),
    "gpt_oss": GptOss(),
}
# Families whose output the gateway knows but whose KV the bridge does not carry (family_for refuses them)
OUTPUT_ONLY: dict[str, Family] = {
    "qwen3": Qwen3(),
    "qwen2": Qwen2(),
}

__all__ = ["FAMILIES", "OUTPUT_ONLY", "Family", "FamilyConfigError", "LayerSpec", "family_for", "output_family",
           "vllm_hf_overrides", "vllm_hf_override_fn", "check_vllm_hf_config"]


def family_for(model_type: str | None) -> Family:
    """The family of `model_type`; an unknown one is refused with a message that names it."""
    fam = FAMILIES.get(model_type or "")
    if fam is None:
        raise ValueError(f"model_type {model_type!r} is not supported by the KV bridge; supported: "
                         f"{sorted(FAMILIES)} (add kv_bridge/families/<family>.py and register it in FAMILIES)")
    return fam


def output_family(model_type: str | None) -> Family:
    """The family whose output formats a model of `model_type` writes; an unknown type gets the plain Family (no
    reasoning split, no tool-call parsing), as the gateway serves any model mlx-lm loads."""
    return FAMILIES.get(model_type or "") or OUTPUT_ONLY.get(model_type or "") or Family()


def _config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def vllm_hf_overrides(folder: str | Path) -> dict:
    """`hf_overrides` for vLLM serving the HF folder, so it computes the KV mlx-lm computes (prefill start-up)."""
    cfg = _config(folder)
    fam = family_for(cfg.get("model_type"))
    fam.check_config(cfg)
    return fam.vllm_hf_overrides(cfg)


def vllm_hf_override_fn(folder: str | Path):
    """`vllm_hf_overrides` as the callable vLLM applies to the target's config and to its EAGLE-3 head's (a dict
    reaches the target only), or None where the family overrides nothing."""
    cfg = _config(folder)
    return family_for(cfg.get("model_type")).vllm_hf_override_fn(cfg)


def check_vllm_hf_config(folder: str | Path, effective: Mapping) -> None:
    """Refuse a vLLM engine whose effective HF config lacks the family's overrides (its KV would not be mlx-lm's).

    effective: the engine's config as a dict (vllm_config.model_config.hf_config.to_dict()).
    """
    for key, want in vllm_hf_overrides(folder).items():
        have = effective.get(key)
        wrong = ({k: (have or {}).get(k) for k in want if (have or {}).get(k) != want[k]}
                 if isinstance(want, Mapping) else ({key: have} if have != want else {}))
        if wrong:
            raise FamilyConfigError(f"vLLM runs {folder} with {key} {wrong}, mlx-lm computes with {want}; start vLLM "
                                    f"with hf_overrides=kv_bridge.families.vllm_hf_overrides(model folder)")
