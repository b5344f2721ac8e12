"""Forced tool calls (tool_choice "required" or a named function): the gateway's grammar for each call format
compiles in llguidance against the family tokenizers and admits exactly the calls the parsers read back (real token
sequences of the formats), the request carries it to the decode node, and bad choices are 400s naming tool_choice.
A real decode node masking by it: tests/gateway/api/test_gpt_oss_e2e.py."""

from __future__ import annotations

import json

import pytest

from backends.decode.grammar import GrammarCompiler, GrammarSpec
from tests.support.fakes import MODEL_ID
from gateway.text.toolcalls.forced import allowed_tools, forced_call_grammar
from tests.support.toolcalls import ARGS, MESSAGES, QWEN_CALL, TOOLS, tool_cluster
from tests.support.tiny_models import write_family_tokenizer

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
WEATHER = '{"city": "Paris", "days": 2}'
CALLS = {
    "harmony": [
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + WEATHER + "<|call|>",
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>" + WEATHER + "<|call|>",
    ],
    "qwen3_coder": [QWEN_CALL[len("Let me check.\n"):],
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
                    "</function>\n</tool_call>"],
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>'],
}
WRONG = {  # a call to the other tool (refused when the choice names get_weather), or a malformed one
    "harmony": ["<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>",
                "<|channel|>final<|message|>Paris is sunny."],
    "qwen3_coder": ["<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"],  # city is required
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"days": "two"}}\n</tool_call>', "Sure: Paris"],
}
FAMILY = {"harmony": "gpt_oss", "qwen3_coder": "qwen3_moe", "hermes": "qwen3_moe"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    out = {}
    for family in set(FAMILY.values()):
        folder = write_family_tokenizer(tmp_path_factory.mktemp(family), family)
        out[family] = AutoTokenizer.from_pretrained(str(folder))
    return out


def _matcher(tokenizers, parser: str, tools: list[dict]):
    hf = tokenizers[FAMILY[parser]]
    wire = forced_call_grammar(parser, tools, lambda t: t in hf.get_added_vocab())
    assert wire["type"] == "lark"
    compiler = GrammarCompiler(hf, len(hf), [hf.eos_token_id])
    return hf, lambda: compiler.processor(GrammarSpec.from_wire(wire)).matcher


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_forced_grammar_admits_the_formats_calls_and_nothing_else(tokenizers, parser):
    hf, matcher = _matcher(tokenizers, parser, allowed_tools([*TOOLS, TIME], {"function": {"name": "get_weather"}}))
    for text in CALLS[parser]:
        m = matcher()
        assert m.consume_tokens(hf.encode(text, add_special_tokens=False)), (text, m.get_error())
        assert m.is_accepting(), text
    for text in WRONG[parser]:
        m = matcher()
        ids = hf.encode(text, add_special_tokens=False)
        assert not (m.consume_tokens(ids) and m.is_accepting()), text


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_required_admits_every_tool(tokenizers, parser):
    hf, matcher = _matcher(tokenizers, parser, allowed_tools([*TOOLS, TIME], "required"))
    other = {"harmony": "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>",
             "qwen3_coder": "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
             "hermes": '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'}[parser]
    for text in [CALLS[parser][0], other]:
        m = matcher()
        assert m.consume_tokens(hf.encode(text, add_special_tokens=False)) and m.is_accepting(), text


def test_allowed_tools_and_unknown_formats():
    assert allowed_tools([*TOOLS, TIME], "required") == [*TOOLS, TIME]
    assert allowed_tools([*TOOLS, TIME], {"type": "function", "function": {"name": "get_time"}}) == [TIME]
    with pytest.raises(ValueError, match="'nope', which is not in tools"):
        allowed_tools(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tool_choice must be"):
        allowed_tools(TOOLS, "sometimes")
    with pytest.raises(ValueError, match="cannot be forced"):
        forced_call_grammar("", TOOLS, lambda t: False)


async def test_required_reaches_the_decode_node_as_a_grammar(tmp_path, empty_config):
    c = await tool_cluster(tmp_path, "qwen3_moe", QWEN_CALL[len("Let me check.\n"):])
    try:
        body = {"model": MODEL_ID, "messages": MESSAGES, "tools": [*TOOLS, TIME], "max_tokens": 200}
        named = {"type": "function", "function": {"name": "get_weather"}}
        status, _, out = await c.chat({**body, "tool_choice": named})
        assert status == 200, out
        grammar = c.decode.requests[-1]["grammar"]
        assert grammar["type"] == "lark" and "<function=get_weather>" in grammar["grammar"]
        assert "get_time" not in grammar["grammar"]
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == ARGS

        for bad, needle in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
                            ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
                            ({"tool_choice": "required", "tools": None}, "requires tools")]:
            status, _, out = await c.chat({**body, **bad})
            assert status == 400 and out["error"]["param"] == "tool_choice" and needle in out["error"]["message"]
    finally:
        await c.stop()
