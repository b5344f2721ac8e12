"""POST /v1/messages and /v1/messages/count_tokens through the real gateway with fake nodes, read by the official
`anthropic` SDK unchanged: text, stop sequences, tools (qwen3-coder XML calls, gpt-oss harmony calls with thinking
blocks), streaming events, tool results in the next turn, and errors and keys in Anthropic's shape."""

from __future__ import annotations

import pytest

from fakes import MODEL_ID, REPLY, Cluster
from test_toolcalls_api import ARGS, HARMONY_CALL, QWEN_CALL, _cluster

import anthropic

TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}]
ASK = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _client(c: Cluster, **kw):
    return anthropic.AsyncAnthropic(base_url=c.url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


async def test_text_answer_usage_count_tokens_and_metrics(local_cluster):
    c = local_cluster
    client = _client(c)
    raw = await client.messages.with_raw_response.create(model=MODEL_ID, max_tokens=50, messages=QUESTION,
                                                         system="Answer briefly.")
    assert raw.headers["x-disagg-path"] == "local"
    m = await raw.parse()
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "end_turn"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == REPLY
    prompt = c.decode.requests[-1]["token_ids"]
    assert m.usage.input_tokens == len(prompt) and m.usage.output_tokens == len(c.decode.reply_ids)
    assert "Answer briefly." in c.decode.tok.decode(prompt, skip_special_tokens=False)
    counted = await client.messages.count_tokens(model=MODEL_ID, messages=QUESTION, system="Answer briefly.")
    assert counted.input_tokens == len(prompt)
    assert await c.metric("disagg_requests_total", model=MODEL_ID, path="local", status="ok") == 1

    m = await client.messages.create(model=MODEL_ID, max_tokens=3, messages=QUESTION)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    m = await client.messages.create(model=MODEL_ID, max_tokens=50, messages=QUESTION, stop_sequences=["xyz", " is"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " is" and m.content[0].text == "The capital of France"
    await client.close()


async def test_streamed_text_events(local_cluster):
    client = _client(local_cluster)
    kinds = []
    async with client.messages.stream(model=MODEL_ID, max_tokens=50, messages=QUESTION) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == REPLY and final.content[0].text == REPLY and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(local_cluster.decode.reply_ids)
    raw = await client.messages.create(model=MODEL_ID, max_tokens=50, messages=QUESTION, stream=True)
    async for ev in raw:
        kinds.append(ev.type)
    dedup = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert dedup == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    await client.close()


@pytest.fixture(params=[("qwen3_moe", QWEN_CALL, "Let me check.\n", ""), ("gpt_oss", HARMONY_CALL, "",
                                                                          "Need weather.")])
async def family(request, tmp_path, empty_config):
    name, reply, text, thinking = request.param
    c = await _cluster(tmp_path, name, reply)
    yield c, text, thinking
    await c.stop()


async def test_tool_use_and_thinking_blocks(family):
    c, text, thinking = family
    client = _client(c)
    m = await client.messages.create(model=MODEL_ID, max_tokens=200, messages=ASK, tools=TOOLS)
    kinds = (["thinking"] if thinking else []) + (["text"] if text else []) + ["tool_use"]
    assert [b.type for b in m.content] == kinds and m.stop_reason == "tool_use"
    use = m.content[-1]
    assert use.name == "get_weather" and use.input == ARGS and use.id
    if thinking:
        assert m.content[0].thinking == thinking
    if text:
        assert m.content[-2].text == text

    async with client.messages.stream(model=MODEL_ID, max_tokens=200, messages=ASK, tools=TOOLS) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == kinds and final.content[-1].input == ARGS
    assert final.stop_reason == "tool_use"
    if thinking:
        assert final.content[0].thinking == thinking

    # The next turn: the assistant's tool_use and the user's tool_result render through the template.
    turn = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}]
    counted = await client.messages.count_tokens(model=MODEL_ID, messages=turn, tools=TOOLS)
    await client.messages.create(model=MODEL_ID, max_tokens=200, messages=turn, tools=TOOLS)
    ids = c.decode.requests[-1]["token_ids"]
    prompt = c.decode.tok.decode(ids, skip_special_tokens=False)
    assert "sunny, 21 C" in prompt and "get_weather" in prompt and "Paris" in prompt
    assert counted.input_tokens == len(ids)
    # tool_choice none: the call stays text.
    m = await client.messages.create(model=MODEL_ID, max_tokens=200, messages=ASK, tools=TOOLS,
                                     tool_choice={"type": "none"})
    assert m.stop_reason == "end_turn" and all(b.type != "tool_use" for b in m.content)
    await client.close()


async def test_errors_in_anthropic_shape(local_cluster):
    c = local_cluster
    client = _client(c)
    with pytest.raises(anthropic.NotFoundError) as e:
        await client.messages.create(model="nope", max_tokens=10, messages=QUESTION)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    for bad in [{"max_tokens": 0}, {"messages": []}, {"extra_body": {"temperature": 1.5}},
                {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}]:
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(**{"model": MODEL_ID, "max_tokens": 10, "messages": QUESTION, **bad})
        assert e.value.body["error"]["type"] == "invalid_request_error", bad
    async with c.http.post(c.url + "/v1/messages", json={"model": MODEL_ID, "messages": QUESTION}) as r:
        body = await r.json()
    assert r.status == 400 and body["type"] == "error" and "max_tokens" in body["error"]["message"]
    async with c.http.post(c.url + "/v1/messages/nothing", json={}) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
    await client.close()


async def test_key_as_x_api_key_or_bearer(empty_config, monkeypatch):
    monkeypatch.setenv("DISAGG_AUTH__API_KEYS", "sk-one")
    c = await Cluster(n_prefill=0).start()
    try:
        ok = await _client(c, api_key="sk-one").messages.create(model=MODEL_ID, max_tokens=5, messages=QUESTION)
        assert ok.content[0].text
        bearer = anthropic.AsyncAnthropic(base_url=c.url, auth_token="sk-one", max_retries=0)
        assert (await bearer.messages.count_tokens(model=MODEL_ID, messages=QUESTION)).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as e:
            await _client(c, api_key="sk-wrong").messages.create(model=MODEL_ID, max_tokens=5, messages=QUESTION)
        assert e.value.body["error"]["type"] == "authentication_error"
        async with c.http.post(c.url + "/v1/messages", json={}) as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
    finally:
        await c.stop()


async def test_output_config_format_and_effort(tmp_path, empty_config):
    """output_config.format becomes the decode node's JSON-schema grammar; effort and thinking reach the template."""
    c = await _cluster(tmp_path, "gpt_oss", HARMONY_CALL)
    try:
        client = _client(c)
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        await client.messages.create(model=MODEL_ID, max_tokens=20, messages=QUESTION,
                                     output_config={"effort": "max", "format": {"type": "json_schema",
                                                                                "schema": schema}})
        sent = c.decode.requests[-1]
        assert sent["grammar"]["schema"] == schema
        assert "Reasoning: high" in c.decode.tok.decode(sent["token_ids"], skip_special_tokens=False)
        await client.messages.create(model=MODEL_ID, max_tokens=20, messages=QUESTION,
                                     thinking={"type": "disabled"})  # harmony cannot stop reasoning: low
        assert "Reasoning: low" in c.decode.tok.decode(c.decode.requests[-1]["token_ids"], skip_special_tokens=False)
        await client.messages.create(model=MODEL_ID, max_tokens=5, messages=QUESTION,
                                     extra_body={"temperature": 0.5, "seed": 7, "logit_bias": {"11": 5}})
        sent = c.decode.requests[-1]
        assert (sent["seed"], sent["logit_bias"], sent["temperature"]) == (7, {"11": 5.0}, 0.5)
        await client.close()
    finally:
        await c.stop()


async def test_a_failure_mid_stream_ends_in_an_error_event(local_cluster):
    c = local_cluster
    c.decode.mode = "fail_mid_stream"
    client = _client(c)
    with pytest.raises(anthropic.APIStatusError) as e:
        async with client.messages.stream(model=MODEL_ID, max_tokens=50, messages=QUESTION) as stream:
            await stream.get_final_message()
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
    await client.close()
