"""Reasoning kept across tool turns on the Responses and Messages APIs: a `reasoning` input item the client sends back
(Codex does, with `store: false`), the stored response a `previous_response_id` continues, or a `thinking` block of an
assistant turn (Claude Code sends them back) reaches gpt-oss's chat template as the chat APIs' reasoning passback does,
so the second turn's prompt carries the first turn's analysis before its call. Reference: transformers'
apply_chat_template on the conversation as the published template reads it (`thinking`)."""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import MODEL_ID, Cluster
from tests.support.family_streams import family_tokenizers
from tests.support.tiny_models import write_family_tokenizer

import anthropic
import openai

ANALYSIS = "Need the weather in Paris; call the tool."
FIRST = [{"role": "user", "content": "Weather in Paris?"}]
RESULT = "sunny, 21 C"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": RESULT}
HARMONY = (f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>commentary "
           "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")


CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


@pytest.fixture
async def gpt_oss(tmp_path, empty_config):
    folder = write_family_tokenizer(tmp_path / "gpt_oss", "gpt_oss")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    c = await Cluster(n_prefill=0, model_dir=folder).start()
    c.decode.speak(folder, "<|channel|>final<|message|>Fine.")
    c.folder, c.root = folder, str(tmp_path / "ref")
    yield c
    await c.stop()


def reference_ids(c: Cluster, messages: list[dict]) -> list[int]:
    """The prompt ids transformers renders from the messages as the published gpt-oss template reads them."""
    hf, _ = family_tokenizers("gpt_oss", c.root)  # the same family tokenizer folder, template included
    return hf.apply_chat_template(messages, tools=CHAT_TOOLS, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)


def as_published(call_id: str = "call_1") -> list[dict]:
    """The second turn's conversation in the published template's terms: the analysis in `thinking`."""
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return [*FIRST, {"role": "assistant", "content": "", "thinking": ANALYSIS, "tool_calls": [call]},
            {"role": "tool", "name": "get_weather", "content": RESULT}]


def sent_ids(c: Cluster) -> list[int]:
    return c.decode.requests[-1]["token_ids"]


def _client(c) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)


def _prompt(c) -> str:
    return c.decode.tok.decode(sent_ids(c), skip_special_tokens=False)


@pytest.mark.parametrize("part", ["content", "summary"])
async def test_reasoning_item_of_a_tool_call_turn_reaches_the_template(gpt_oss, part):
    """The item as this gateway answers it (`content` reasoning_text), or as a summary-only client keeps it."""
    kind = "reasoning_text" if part == "content" else "summary_text"
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], part: [{"type": kind, "text": ANALYSIS}]}
    client = _client(gpt_oss)
    await client.responses.create(model=MODEL_ID, input=[*FIRST, reasoning, CALL, OUTPUT], tools=TOOLS,
                                  max_output_tokens=8, store=False)
    assert sent_ids(gpt_oss) == reference_ids(gpt_oss, as_published())
    assert (f"<|start|>assistant<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather") in _prompt(gpt_oss)
    await client.close()


async def test_first_turns_reasoning_item_sent_back_as_codex_does(gpt_oss):
    """Turn 1 answers a reasoning item and a call (streamed, store false); turn 2 sends the whole conversation back,
    the SDK's own output items appended as they came, plus the tool's output: the rendered prompt equals
    transformers' rendering of the same conversation."""
    c = gpt_oss
    c.decode.speak(c.folder, HARMONY)
    client = _client(c)
    async with client.responses.stream(model=MODEL_ID, input=FIRST, tools=TOOLS, store=False) as stream:
        first = await stream.get_final_response()
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == ANALYSIS
    items = [o.model_dump(exclude_none=True) for o in first.output]
    call_id = first.output[1].call_id
    c.decode.speak(c.folder, "<|channel|>final<|message|>Sunny.")
    await client.responses.create(model=MODEL_ID, tools=TOOLS, store=False, max_output_tokens=8,
                                  input=[*FIRST, *items, {**OUTPUT, "call_id": call_id}])
    assert sent_ids(c) == reference_ids(c, as_published(call_id))
    await client.close()


async def test_previous_response_keeps_its_reasoning(gpt_oss):
    """The stored turn carries its reasoning too: continuing by previous_response_id renders the same prompt."""
    c = gpt_oss
    c.decode.speak(c.folder, HARMONY)
    client = _client(c)
    first = await client.responses.create(model=MODEL_ID, input=FIRST, tools=TOOLS)
    call_id = first.output[-1].call_id
    await client.responses.create(model=MODEL_ID, tools=TOOLS, previous_response_id=first.id, max_output_tokens=8,
                                  input=[{**OUTPUT, "call_id": call_id}])
    assert sent_ids(c) == reference_ids(c, as_published())
    await client.close()


async def test_final_answer_drops_its_reasoning_and_items_merge_into_one_turn(gpt_oss):
    """A reasoning item then the assistant's message is one assistant turn (its analysis dropped by the template
    once answered, as the chat API's is); reasoning with nothing after it renders nothing stray."""
    c = gpt_oss
    client = _client(c)
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}
    reasoning = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": ANALYSIS}]}
    chat = [*FIRST, {"role": "assistant", "content": "Sunny.", "thinking": ANALYSIS},
            {"role": "user", "content": "And Oslo?"}]
    await client.responses.create(model=MODEL_ID, input=[*FIRST, reasoning, answer, chat[2]], tools=TOOLS,
                                  max_output_tokens=8)
    assert sent_ids(c) == reference_ids(c, chat) and ANALYSIS not in _prompt(c)
    await client.close()


async def test_thinking_block_of_a_tool_use_turn_reaches_the_template(gpt_oss):
    """Anthropic's assistant turn [thinking, tool_use] then the tool_result: the same prompt as the chat API's."""
    client = anthropic.AsyncAnthropic(base_url=gpt_oss.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": TOOLS[0]["parameters"]}]
    turn = [*FIRST, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": ANALYSIS, "signature": ""},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": RESULT}]}]
    await client.messages.create(model=MODEL_ID, messages=turn, tools=tools, max_tokens=8)
    assert sent_ids(gpt_oss) == reference_ids(gpt_oss, as_published())
    redacted = {"type": "redacted_thinking", "data": "opaque"}  # nothing to give back: the analysis is absent
    turn[1]["content"][0] = redacted
    await client.messages.create(model=MODEL_ID, messages=turn, tools=tools, max_tokens=8)
    no_analysis = as_published()
    no_analysis[1].pop("thinking")
    assert sent_ids(gpt_oss) == reference_ids(gpt_oss, no_analysis)
    await client.close()
