"""gateway/toolcalls on real token sequences: a call the family's chat template renders (an assistant turn with
tool_calls) parses back to the same name and arguments, streamed by token or in any text chunks; malformed calls
come back as text, never an exception."""

from __future__ import annotations

import json
import random

import pytest

from tests.support.family_streams import char_chunks, family_tokenizers, run, token_stream
from tests.support.tiny_models import TEMPLATES_DIR
from gateway.text.toolcalls import PARSERS, ToolCall, tool_parser

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}}}}}}]
ARGS = {"city": "Paris", "days": 3, "metric": True, "hours": [9, 12]}
# family, template file, parser
FORMATS = [("qwen3_moe", "qwen3_coder.jinja", "qwen3_coder"), ("qwen3_moe", "qwen3.jinja", "hermes"),
           ("gpt_oss", "gpt_oss.jinja", "harmony")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("family"))


def _rendered_call(root: str, family: str, template: str, content: str = "") -> str:
    """The assistant turn's text, as the family's template renders a call in history: what the model was taught."""
    hf, _ = family_tokenizers(family, root)
    chat_template = (TEMPLATES_DIR / template).read_text()
    user = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]}
    before = hf.apply_chat_template(user, tools=TOOLS, chat_template=chat_template, tokenize=False,
                                    add_generation_prompt=True)
    after = hf.apply_chat_template([*user, call], tools=TOOLS, chat_template=chat_template, tokenize=False)
    assert after.startswith(before)
    turn = after[len(before):]
    return turn.split("<|im_end|>")[0]  # ChatML: the turn ends at <|im_end|>, the model's EOS


@pytest.mark.parametrize("family,template,fmt", FORMATS)
def test_rendered_call_parses_back(root, family, template, fmt):
    text = _rendered_call(root, family, template)
    ids, chunks = token_stream(family, root, text)
    d = run(tool_parser(fmt, TOOLS), chunks)
    (call,) = d.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS
    assert d.content.strip() == ""
    for size in (1, 3, 11):
        again = run(tool_parser(fmt, TOOLS), char_chunks(text, size))
        assert [(c.name, c.arguments) for c in again.calls] == [(call.name, call.arguments)]


@pytest.mark.parametrize("family,template,fmt", FORMATS[:2])
def test_text_before_a_call_streams_as_content(root, family, template, fmt):
    text = _rendered_call(root, family, template, content="Let me check.")
    _, chunks = token_stream(family, root, text)
    p = tool_parser(fmt, TOOLS)
    first = [p.feed(c) for c in chunks]
    assert "".join(d.content for d in first).strip() == "Let me check."
    assert sum(len(d.calls) for d in first) == 1


MALFORMED = {
    "hermes": ["<tool_call>{\"name\": \"f\", \"arguments\": {</tool_call>", "<tool_call>[1, 2]</tool_call>",
               "<tool_call>{\"arguments\": {}}</tool_call>",
               "<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call>",
               "<tool_call>{\"name\": \"f\""],
    # A dropped </parameter> or a cut-off value is recovered (tests/gateway/text/toolcalls/test_toolcalls_qwen3_vllm.py); harmony never
    # gives markup back as text (tests/gateway/text/test_harmony_markup.py).
    "qwen3_coder": ["<tool_call>no function here</tool_call>", "<tool_call>\n<function=f oops</tool_call>"],
}


@pytest.mark.parametrize("fmt", sorted(MALFORMED))
def test_malformed_calls_come_back_as_text(fmt):
    for text in MALFORMED[fmt]:
        d = run(tool_parser(fmt, TOOLS), [text])
        assert d.calls == [] and d.content.strip(), text


@pytest.mark.parametrize("family,template,fmt", FORMATS)
def test_truncated_and_corrupted_calls_never_raise(root, family, template, fmt):
    text = _rendered_call(root, family, template)
    rng = random.Random(0)
    for _ in range(60):
        cut = text[:rng.randrange(len(text))]
        at = rng.randrange(len(text))
        noisy = text[:at] + rng.choice(["}", "<", "\"", "</parameter>", "<|end|>"]) + text[at:]
        for sample in (cut, noisy):
            d = run(tool_parser(fmt, TOOLS), char_chunks(sample, rng.randint(1, 9)))
            assert all(isinstance(c, ToolCall) for c in d.calls)


def test_qwen3_coder_values_take_their_schema_types():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n<parameter=days>\nthree\n"
            "</parameter>\n<parameter=extra>\n{\"a\": 1}\n</parameter>\n</function>\n</tool_call>")
    (call,) = run(tool_parser("qwen3_coder", TOOLS), [text]).calls
    assert json.loads(call.arguments) == {"city": "New\nYork", "days": "three", "extra": "{\"a\": 1}"}


def test_several_calls_and_api_shapes():
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>')
    calls = run(tool_parser("hermes"), [text]).calls
    assert [c.openai(i)["function"] for i, c in enumerate(calls)] == [
        {"name": "a", "arguments": '{"x": 1}'}, {"name": "b", "arguments": '{"y": [2]}'}]
    assert calls[1].openai(1)["index"] == 1 and calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert calls[1].ollama() == {"function": {"name": "b", "arguments": {"y": [2]}}}


def test_registry():
    assert set(PARSERS) == {"hermes", "qwen3_coder", "harmony"}
    with pytest.raises(ValueError, match="known: harmony, hermes, qwen3_coder"):
        tool_parser("mistral")
