"""qwen2 (Qwen2, Qwen2.5): output only. The gateway reads its hermes tool calls; the KV bridge does not carry its KV
(family_for refuses it)."""

from __future__ import annotations

from kv_bridge.families.base import Family


class Qwen2(Family):
    model_type = "qwen2"
    tool_parser = "hermes"
