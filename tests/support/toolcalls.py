"""A gateway over a fake decode node that speaks a family's tool calls (qwen3-coder XML, gpt-oss harmony) with that
family's real tokenizer, and the weather tool those tests call (test_toolcalls_api, test_toolcalls_forced, the
Responses and Anthropic API tests)."""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import Cluster
from tests.support.tiny_models import write_family_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
QWEN_CALL = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
# gpt-oss: reasoning, then a call that ends with <|call|> (an EOS token: the node sends no text for it).
HARMONY_CALL = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 2}")
MESSAGES = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
ARGS = {"city": "Paris", "days": 2}


async def tool_cluster(tmp_path, family: str, reply: str) -> Cluster:
    folder = write_family_tokenizer(tmp_path / family, family)
    (folder / "config.json").write_text(json.dumps({"model_type": family}))
    c = await Cluster(n_prefill=0, model_dir=folder).start()
    c.decode.speak(folder, reply)
    return c


@pytest.fixture(params=[("qwen3_moe", QWEN_CALL, "Let me check.\n", ""),
                        ("gpt_oss", HARMONY_CALL, "", "Need weather.")], ids=["qwen3_moe", "gpt_oss"])
async def tool_family(request, tmp_path, empty_config):
    """A fake cluster answering each family's real tool-call tokens: (cluster, the text before the call, the
    reasoning before it)."""
    name, reply, text, reasoning = request.param
    c = await tool_cluster(tmp_path, name, reply)
    yield c, text, reasoning
    await c.stop()
