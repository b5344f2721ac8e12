"""What the bridge must know about a model family: which layers slide (and by how much), which configs the
two engines (vLLM prefill, mlx-lm decode) would compute differently and so must be refused; and what the gateway
must know of its output: the reasoning and tool-call formats it writes by default.

A family reads the HF config as a mapping (config.json, or mlx-lm's ModelArgs as a dict).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


class FamilyConfigError(ValueError):
    """The checkpoint's config makes vLLM and mlx-lm compute different KV; the message says what and the fix."""


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer as both engines run it.

    window: sliding-window length in tokens, the query's own token included (HF `sliding_window`);
            None for full attention. keep: leading tokens a sliding layer never evicts (mlx-lm `keep`).
    """

    window: int | None = None
    keep: int = 0


class Family:
    model_type: str = ""
    # The formats the family's output comes in, by the names of the gateway's parser registries (gateway/text:
    # REASONING_PARSERS, toolcalls.PARSERS); config.toml `reasoning_parser` / `tool_parser` override them. None: no
    # reasoning split, no tool-call parsing.
    reasoning_parser: str | None = None
    tool_parser: str | None = None

    def check_config(self, cfg: Mapping) -> None:
        """Raise FamilyConfigError for a config the engines would compute differently."""

    def layer_specs(self, cfg: Mapping) -> list[LayerSpec]:
        """One LayerSpec per decoder layer, in order."""
        return [LayerSpec() for _ in range(int(cfg["num_hidden_layers"]))]

    def vllm_hf_overrides(self, cfg: Mapping) -> dict:
        """hf_overrides the prefill node passes to vLLM so it computes what mlx-lm computes (default none)."""
        return {}

    def vllm_hf_override_fn(self, cfg: Mapping):
        """The same as a callable (vLLM applies a callable to a speculative head's config too), or None."""
        return None


def layer_types_specs(cfg: Mapping) -> list[LayerSpec]:
    """Specs from HF `layer_types` ("full_attention" / "sliding_attention") and `sliding_window`."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["full_attention"] * n
    if len(types) != n:
        raise FamilyConfigError(f"config has {len(types)} layer_types for {n} layers; fix layer_types in config.json")
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise FamilyConfigError(f"layer_types {sorted(unknown)} are not supported by the KV bridge "
                                "(full_attention and sliding_attention are)")
    if "sliding_attention" in types and not cfg.get("sliding_window"):
        raise FamilyConfigError("layer_types has sliding_attention layers but sliding_window is not set")
    return [LayerSpec(int(cfg["sliding_window"])) if t == "sliding_attention" else LayerSpec() for t in types]
