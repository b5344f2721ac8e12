"""gpt_oss (gpt-oss-20b/120b): sliding-window and full attention layers alternate, attention sinks, yarn rope.

vLLM slides the even layers (layer_idx % 2 == 0, ignoring `layer_types`); mlx-lm follows `layer_types` and
keeps a sliding layer in RotatingKVCache(max_size=sliding_window). Sinks are per-head softmax logits, not KV.
Yarn: the real config says `rope_scaling.truncate: false`; vLLM honours it, mlx-lm always truncates the
correction range (floor/ceil), so the engines rotate keys differently. The prefill node must run vLLM with
`vllm_hf_overrides()` (truncate=True) so the KV it sends is the KV mlx-lm would compute and keeps computing. An
EAGLE-3 head for gpt-oss copies the target's rope, truncate: false included, and vLLM hands a head only a callable
hf_overrides (a dict patches the target alone): the prefill node passes `truncate_yarn`, which patches both.
"""

from __future__ import annotations

from collections.abc import Mapping

from kv_bridge.families.base import Family, FamilyConfigError, LayerSpec


def _rope(cfg: Mapping) -> dict:
    """Rope parameters as vLLM reads them (transformers 5 `rope_parameters`: rope_scaling + rope_theta)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" not in rope and cfg.get("rope_theta") is not None:
        rope["rope_theta"] = cfg["rope_theta"]
    return rope


def truncate_yarn(hf_config):
    """vLLM hf_overrides as a callable, which vLLM applies to the target's config and to a speculative head's: a YaRN
    rope with truncate false gets truncate true, as mlx-lm computes it (module level: vLLM pickles it to its engine
    process)."""
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(hf_config, name, None)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("truncate") is False:
            setattr(hf_config, name, {**rope, "truncate": True})
    return hf_config


class GptOss(Family):
    model_type = "gpt_oss"
    reasoning_parser = tool_parser = "harmony"  # analysis/final channels; calls are messages to=functions.NAME

    def check_config(self, cfg: Mapping) -> None:
        n = int(cfg["num_hidden_layers"])
        vllm_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        types = cfg.get("layer_types")
        if types is not None and list(types) != vllm_types:
            raise FamilyConfigError("gpt_oss layer_types must alternate sliding_attention, full_attention, ... "
                                    "(vLLM slides the even layers whatever layer_types says); got "
                                    f"{list(types)}")
        if not cfg.get("sliding_window"):
            raise FamilyConfigError("gpt_oss config has no sliding_window; set it (gpt-oss ships 128)")

    def layer_specs(self, cfg: Mapping) -> list[LayerSpec]:
        self.check_config(cfg)
        w = int(cfg["sliding_window"])
        return [LayerSpec(w) if i % 2 == 0 else LayerSpec() for i in range(int(cfg["num_hidden_layers"]))]

    def vllm_hf_overrides(self, cfg: Mapping) -> dict:
        rope = _rope(cfg)
        if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("truncate", True) is False:
            return {"rope_parameters": {**rope, "truncate": True}}
        return {}

    def vllm_hf_override_fn(self, cfg: Mapping):
        return truncate_yarn if self.vllm_hf_overrides(cfg) else None
