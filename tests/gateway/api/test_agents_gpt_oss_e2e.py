"""The Responses and Anthropic Messages APIs on the tiny gpt_oss checkpoint (harmony template, real mlx-cpu decode
node, real gateway), through the official SDKs unchanged: reasoning items and thinking blocks from the analysis
channel, and function_call items and tool_use blocks from a forced tool call, whole and streamed, then the tool's
result in the next turn. A random model emits no harmony by itself: as in test_gpt_oss_e2e.py, tool_choice masks
the output into harmony and logit_bias picks the channel. On the shared tiny-gpt_oss stack (tests/support/oss_fixtures.py)."""

from __future__ import annotations

import json

import pytest

from tests.support.stack import MODEL_ID

import openai
import anthropic
pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                           "days": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["unit", "days"], "additionalProperties": False}
NAMES = ("get_weather", "set_unit")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def oss(oss_stack):
    """(openai client, anthropic client, the token ids that spell a prefix of "analysis" only) on the shared stack."""
    vocab = json.loads((oss_stack.folder / "tokenizer.json").read_text())["model"]["vocab"]
    analysis = [i for t, i in vocab.items() if t and "analysis".startswith(t) and not "commentary".startswith(t)]
    url = oss_stack.stack.url("gateway")
    return (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300),
            anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300), analysis)


def _bias(analysis: list[int], value: int) -> dict:
    return {str(i): value for i in analysis}


def test_reasoning_items_and_thinking_blocks(oss):
    """Forced into the analysis channel (and kept there by the bias), the model reasons until max tokens: the
    chat API's reasoning_content, the Responses reasoning item and the Anthropic thinking block are that text."""
    oai, ant, analysis = oss
    tools = [{"type": "function", "function": {"name": "set_unit", "parameters": SCHEMA}}]
    extra = {"temperature": 0, "logit_bias": _bias(analysis, 100)}
    chat = oai.chat.completions.create(model=MODEL_ID, messages=HI, tools=tools, tool_choice="required",
                                       max_tokens=8, **extra)
    reasoning = chat.choices[0].message.reasoning_content
    assert reasoning and chat.choices[0].finish_reason == "length"

    flat = [{"type": "function", "name": "set_unit", "parameters": SCHEMA}]
    r = oai.responses.create(model=MODEL_ID, input="hi", tools=flat, tool_choice="required", max_output_tokens=8,
                             extra_body=extra)
    assert r.status == "incomplete" and [o.type for o in r.output] == ["reasoning"]
    assert r.output[0].content[0].text == reasoning
    with oai.responses.stream(model=MODEL_ID, input="hi", tools=flat, tool_choice="required", max_output_tokens=8,
                              extra_body=extra) as stream:
        deltas = "".join(ev.delta for ev in stream if ev.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert deltas == reasoning == final.output[0].content[0].text

    anth = [{"name": "set_unit", "input_schema": SCHEMA}]
    m = ant.messages.create(model=MODEL_ID, messages=HI, tools=anth, tool_choice={"type": "any"}, max_tokens=8,
                            extra_body=extra)
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["thinking"]
    assert m.content[0].thinking == reasoning
    with ant.messages.stream(model=MODEL_ID, messages=HI, tools=anth, tool_choice={"type": "any"}, max_tokens=8,
                             extra_body=extra) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking"] and final.content[0].thinking == reasoning


def _check_args(name: str, arguments: dict) -> None:
    assert name in NAMES and arguments["unit"] in ("c", "f") and 0 <= arguments["days"] <= 9, (name, arguments)


def test_responses_function_call_then_its_output(oss):
    oai, _, analysis = oss
    tools = [{"type": "function", "name": n, "parameters": SCHEMA} for n in NAMES]
    kw = {"model": MODEL_ID, "tools": tools, "max_output_tokens": 60,
          "extra_body": {"temperature": 0, "logit_bias": _bias(analysis, -100)}}
    r = oai.responses.create(input="hi", tool_choice={"type": "function", "name": "set_unit"}, **kw)
    (call,) = r.output
    assert r.status == "completed" and call.type == "function_call" and call.name == "set_unit"
    _check_args(call.name, json.loads(call.arguments))
    with oai.responses.stream(input="hi", tool_choice="required", **kw) as stream:
        done = [ev for ev in stream if ev.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and done[0].arguments == call.arguments
    _check_args(call.name, json.loads(call.arguments))
    nxt = oai.responses.create(model=MODEL_ID, tools=tools, previous_response_id=final.id, max_output_tokens=4,
                               input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}],
                               extra_body={"temperature": 0})
    assert nxt.usage.input_tokens > final.usage.input_tokens + final.usage.output_tokens


def test_messages_tool_use_then_its_result(oss):
    _, ant, analysis = oss
    tools = [{"name": n, "input_schema": SCHEMA} for n in NAMES]
    kw = {"model": MODEL_ID, "tools": tools, "max_tokens": 60,
          "extra_body": {"temperature": 0, "logit_bias": _bias(analysis, -100)}}
    m = ant.messages.create(messages=HI, tool_choice={"type": "tool", "name": "set_unit"}, **kw)
    (use,) = m.content
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "set_unit"
    _check_args(use.name, use.input)
    with ant.messages.stream(messages=HI, tool_choice={"type": "any"}, **kw) as stream:
        final = stream.get_final_message()
    (use,) = final.content
    assert final.stop_reason == "tool_use" and use.type == "tool_use"
    _check_args(use.name, use.input)
    turn = [*HI, {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    counted = ant.messages.count_tokens(model=MODEL_ID, messages=turn, tools=tools)
    nxt = ant.messages.create(model=MODEL_ID, messages=turn, tools=tools, max_tokens=4,
                              extra_body={"temperature": 0})
    assert nxt.usage.input_tokens == counted.input_tokens > final.usage.input_tokens
