"""Forced qwen3-coder calls with the parameter schemas clients send (issue 22, item 4): a nullable string (pydantic
`Optional[str]`, MCP), an enum without a type, an untyped parameter. The grammar must admit the call as the chat
template writes it (strings raw) and the parser must read it back unquoted; a string enum admits only its values."""

from __future__ import annotations

import json

import pytest

from backends.decode.grammar import GrammarCompiler, GrammarSpec
from gateway.text.toolcalls import tool_parser
from gateway.text.toolcalls.forced import forced_call_grammar
from tests.support.tiny_models import write_family_tokenizer

TOOL = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "required": ["text", "unit", "extra", "days"], "properties": {
        "text": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "unit": {"enum": ["c", "f"]}, "extra": {},
        "days": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}


def _call(**values: str) -> str:
    """The call as the qwen3-coder template writes one: each value raw on its own line."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function=note>\n{params}</function>\n</tool_call>"


@pytest.fixture(scope="module")
def matcher(tmp_path_factory):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(write_family_tokenizer(tmp_path_factory.mktemp("q"), "qwen3_moe")))
    wire = forced_call_grammar("qwen3_coder", [TOOL], lambda t: t in hf.get_added_vocab())
    compiler = GrammarCompiler(hf, len(hf), [hf.eos_token_id])

    def admits(text: str) -> bool:
        m = compiler.processor(GrammarSpec.from_wire(wire)).matcher
        return m.consume_tokens(hf.encode(text, add_special_tokens=False)) and m.is_accepting()
    return admits


@pytest.mark.parametrize(("values", "args"), [
    ({"text": "buy milk", "unit": "c", "extra": "anything at all", "days": "3"},
     {"text": "buy milk", "unit": "c", "extra": "anything at all", "days": 3}),
    ({"text": "null", "unit": "f", "extra": "x", "days": "null"},
     {"text": None, "unit": "f", "extra": "x", "days": None}),
])
def test_the_template_form_is_admitted_and_reads_back_unquoted(matcher, values, args):
    text = _call(**values)
    assert matcher(text), text
    (call,) = tool_parser("qwen3_coder", [TOOL]).feed(text).calls
    assert json.loads(call.arguments) == args


def test_a_string_enum_admits_only_its_values(matcher):
    assert matcher(_call(text="null", unit="c", extra="1", days="1"))
    assert not matcher(_call(text="null", unit='"c"', extra="1", days="1"))  # quoted: not what the template writes
    assert not matcher(_call(text="null", unit="kelvin", extra="1", days="1"))
