"""qwen3_moe (Qwen3-Coder-30B-A3B): full attention in every layer; q/k RMSNorm precede rope, so the cached
K is normed-then-rotated in both engines. MoE routing does not touch the KV layout.

vLLM's and mlx-lm's qwen3_moe both ignore `use_sliding_window`/`sliding_window` (all layers attend fully),
so the bridge does too; the check below keeps a config that asks otherwise from passing silently.
"""

from __future__ import annotations

from collections.abc import Mapping

from kv_bridge.families.base import Family, FamilyConfigError


class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    # qwen3-coder does not think (a Qwen3 MoE that does names "think" in its config) and writes XML tool calls
    tool_parser = "qwen3_coder"

    def check_config(self, cfg: Mapping) -> None:
        if cfg.get("use_sliding_window"):
            raise FamilyConfigError("qwen3_moe config sets use_sliding_window=true, which neither vLLM nor mlx-lm "
                                    "implements for qwen3_moe (transformers would); set it to false")
