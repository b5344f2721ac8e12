"""qwen3 (dense Qwen3): output only. The gateway splits its `<think>` blocks and reads its hermes tool calls; the KV
bridge does not carry its KV (family_for refuses it until a file here checks it as qwen3_moe.py does)."""

from __future__ import annotations

from kv_bridge.families.base import Family


class Qwen3(Family):
    model_type = "qwen3"
    reasoning_parser = "think"
    tool_parser = "hermes"
