"""llama (SmolLM2, Llama 2/3): full attention everywhere, or per `layer_types` (both engines honour it)."""

from __future__ import annotations

from collections.abc import Mapping

from kv_bridge.families.base import Family, LayerSpec, layer_types_specs


class Llama(Family):
    model_type = "llama"

    def layer_specs(self, cfg: Mapping) -> list[LayerSpec]:
        return layer_types_specs(cfg)
