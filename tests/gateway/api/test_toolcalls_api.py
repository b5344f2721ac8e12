"""Tool calls through the real gateway: a fake decode node streams real qwen3-coder and harmony token sequences
(the family tokenizers' ids), and the official `openai` and `ollama` clients read `tool_calls` unchanged (whole and
streamed with index, finish_reason "tool_calls"); assistant tool_calls and tool results render through the
template."""

from __future__ import annotations

import json

from tests.support.fakes import MODEL_ID
from tests.support.toolcalls import ARGS, MESSAGES, TOOLS, tool_cluster


async def test_openai_client_reads_tool_calls(tool_family):
    import openai
    c, text, _ = tool_family
    client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused")
    r = await client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == ARGS
    assert (choice.message.content or "") == text.strip()  # beside calls, surrounding whitespace is dropped (vLLM)

    stream = await client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                  stream=True)
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state, deltas = ChatCompletionStreamState(), []  # the SDK's own accumulator joins the streamed call
    async for ev in stream:
        state.handle_chunk(ev)
        deltas += [tc for ch in ev.choices for tc in ch.delta.tool_calls or []]
    done = state.get_final_completion().choices[0]
    (call,) = done.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
    assert deltas[0].function.name == "get_weather" and deltas[0].id and all(d.index == 0 for d in deltas)
    # The call streams (issue 22, item 6): the name first, then its arguments over several chunks.
    assert len(deltas) > 2 and all(d.function.name is None and d.id is None for d in deltas[1:])
    assert (done.message.content or "") == text and done.finish_reason == "tool_calls"

    # The next turn: the assistant's call and the tool's result render through the template.
    turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    await client.chat.completions.create(model=MODEL_ID, messages=turn, tools=TOOLS, max_tokens=200)
    prompt = c.decode.tok.decode(c.decode.requests[-1]["token_ids"], skip_special_tokens=False)
    assert "sunny, 21 C" in prompt and "get_weather" in prompt and "Paris" in prompt
    # tool_choice none: the call stays text.
    r = await client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                             max_tokens=200)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    await client.close()


async def test_ollama_client_reads_tool_calls(tool_family):
    import ollama
    c, text, _ = tool_family
    oc = ollama.AsyncClient(host=c.url)
    r = await oc.chat(MODEL_ID, messages=MESSAGES, tools=TOOLS, options={"num_predict": 200})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == ARGS
    assert r.message.content == text
    parts = [p async for p in await oc.chat(MODEL_ID, messages=MESSAGES, tools=TOOLS, stream=True,
                                           options={"num_predict": 200})]
    calls = [tc for p in parts for tc in (p.message.tool_calls or [])]
    assert [(tc.function.name, dict(tc.function.arguments)) for tc in calls] == [("get_weather", ARGS)]


async def test_malformed_call_comes_back_as_text(tmp_path, empty_config):
    bad = "<tool_call>\n<function get_weather>\n<parameter=city>\nParis\n</tool_call>"
    c = await tool_cluster(tmp_path, "qwen3_moe", bad)
    try:
        status, _, body = await c.chat({"model": MODEL_ID, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200})
        assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
        assert not body["choices"][0]["message"].get("tool_calls") and "get_weather" in body["choices"][0]["message"]["content"]
    finally:
        await c.stop()
