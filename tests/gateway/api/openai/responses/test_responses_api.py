"""POST /v1/responses through the real gateway with fake nodes, read by the official `openai` SDK unchanged: text,
tools (qwen3-coder's XML calls, gpt-oss harmony calls with reasoning items), streaming events, previous_response_id
from the store, and errors in OpenAI's shape."""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import MODEL_ID, REPLY, Cluster
from tests.support.oracle import _extras
from tests.support.toolcalls import ARGS, HARMONY_CALL, tool_cluster
from tests.support.tiny_models import write_family_tokenizer

import openai
from openai.types.responses import Response, ResponseStreamEvent
from tests.support import ROOT

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]}}]
ASK = "Weather in Paris for 2 days?"


def _client(c: Cluster):
    return openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)


async def test_text_answer_with_usage_headers_and_metrics(local_cluster):
    c = local_cluster
    client = _client(c)
    raw = await client.responses.with_raw_response.create(model=MODEL_ID, input="What is the capital of France?",
                                                          instructions="Answer briefly.", max_output_tokens=50)
    assert raw.headers["x-disagg-path"] == "local"
    r = raw.parse()
    assert r.status == "completed" and r.output_text == REPLY
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    prompt = c.decode.requests[-1]["token_ids"]
    assert r.usage.input_tokens == len(prompt) and r.usage.output_tokens == len(c.decode.reply_ids)
    text = c.decode.tok.decode(prompt, skip_special_tokens=False)
    assert "Answer briefly." in text and "capital of France" in text  # instructions as the system message
    assert await c.metric("disagg_requests_total", model=MODEL_ID, path="local", status="ok") == 1
    # Cut off by max_output_tokens: incomplete, as OpenAI reports it.
    r = await client.responses.create(model=MODEL_ID, input="hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    async with client.responses.stream(model=MODEL_ID, input="hi", max_output_tokens=3) as stream:
        final = await stream.get_final_response()
    assert final.status == "incomplete" and final.output_text == c.decode.reply_text(3)
    await client.close()


async def test_streamed_text_events(local_cluster):
    client = _client(local_cluster)
    kinds, deltas = [], ""
    async with client.responses.stream(model=MODEL_ID, input="What is the capital of France?") as stream:
        async for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas += ev.delta
        final = await stream.get_final_response()
    assert deltas == REPLY and final.output_text == REPLY and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    order = [k for k in kinds if "delta" not in k]
    assert order[2:] == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                         "response.content_part.done", "response.output_item.done", "response.completed"]
    await client.close()


async def test_function_calls_and_reasoning_items(tool_family):
    c, text, reasoning = tool_family
    client = _client(c)
    r = await client.responses.create(model=MODEL_ID, input=ASK, tools=TOOLS, max_output_tokens=200)
    kinds = [o.type for o in r.output]
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == ARGS
    assert call.call_id and r.output_text == text
    assert kinds == (["reasoning"] if reasoning else []) + (["message"] if text else []) + ["function_call"]
    if reasoning:
        assert r.output[0].content[0].text == reasoning and r.usage.output_tokens_details.reasoning_tokens > 0

    seen: dict[str, str] = {}
    async with client.responses.stream(model=MODEL_ID, input=ASK, tools=TOOLS, max_output_tokens=200) as stream:
        async for ev in stream:
            if ev.type in ("response.reasoning_text.delta", "response.function_call_arguments.delta"):
                seen[ev.type] = seen.get(ev.type, "") + ev.delta
            elif ev.type == "response.function_call_arguments.done":
                seen["done"] = ev.arguments
        final = await stream.get_final_response()
    assert json.loads(seen["done"]) == ARGS == json.loads(seen["response.function_call_arguments.delta"])
    assert seen.get("response.reasoning_text.delta", "") == reasoning
    assert [o.type for o in final.output] == kinds and final.output[-1].name == "get_weather"

    # The next turn continues the stored conversation: only the tool's output is sent.
    nxt = await client.responses.create(model=MODEL_ID, previous_response_id=r.id, tools=TOOLS,
                                        input=[{"type": "function_call_output", "call_id": call.call_id,
                                                "output": "sunny, 21 C"}])
    prompt = c.decode.tok.decode(c.decode.requests[-1]["token_ids"], skip_special_tokens=False)
    assert "sunny, 21 C" in prompt and ASK in prompt and "get_weather" in prompt and "Paris" in prompt
    assert (await client.responses.retrieve(nxt.id)).id == nxt.id
    await client.close()


async def test_input_items_render_through_the_template(local_cluster):
    c = local_cluster
    client = _client(c)
    await client.responses.create(model=MODEL_ID, input=[
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "first question"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "first answer"}]},
        {"role": "user", "content": "second question"}])
    prompt = c.decode.tok.decode(c.decode.requests[-1]["token_ids"], skip_special_tokens=False)
    order = [prompt.index(s) for s in ("Be terse.", "first question", "first answer", "second question")]
    assert order == sorted(order)
    await client.close()


async def test_errors_in_openai_shape(local_cluster):
    client = _client(local_cluster)
    with pytest.raises(openai.NotFoundError) as e:
        await client.responses.create(model=MODEL_ID, input="hi", previous_response_id="resp_gone")
    assert e.value.body["param"] == "previous_response_id" and "resp_gone" in e.value.body["message"]
    # store: false keeps nothing to continue from.
    r = await client.responses.create(model=MODEL_ID, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=MODEL_ID, input="again", previous_response_id=r.id)
    for bad, param in [({"tools": [{"type": "function", "parameters": {}}]}, "tools[0]"),
                       ({"input": [{"type": "message", "role": "user",
                                    "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
                       ({"max_output_tokens": 0}, "max_output_tokens"), ({"model": "nope"}, "model")]:
        with pytest.raises(openai.APIStatusError) as e:
            await client.responses.create(**{"model": MODEL_ID, "input": "hi", **bad})
        assert e.value.status_code in (400, 404) and e.value.body["param"] == param, (bad, e.value.body)
    await client.close()


async def test_text_format_and_reasoning_effort(tmp_path, empty_config):
    """text.format json_schema becomes the decode node's grammar; reasoning.effort reaches the harmony template."""
    c = await tool_cluster(tmp_path, "gpt_oss", HARMONY_CALL)
    try:
        client = _client(c)
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        await client.responses.create(model=MODEL_ID, input="hi", max_output_tokens=20, reasoning={"effort": "high"},
                                      text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                       "strict": True}})
        sent = c.decode.requests[-1]
        assert sent["grammar"]["schema"] == schema
        assert "Reasoning: high" in c.decode.tok.decode(sent["token_ids"], skip_special_tokens=False)
        # vLLM's extra sampling fields ride in the body, as the SDK's extra_body sends them.
        await client.responses.create(model=MODEL_ID, input="hi", max_output_tokens=5, temperature=0.5,
                                      extra_body={"seed": 7, "top_k": 3, "logit_bias": {"11": 5}})
        sent = c.decode.requests[-1]
        assert (sent["seed"], sent["top_k"], sent["logit_bias"], sent["temperature"]) == (7, 3, {"11": 5.0}, 0.5)
        await client.close()
    finally:
        await c.stop()


async def test_a_failure_mid_stream_ends_in_an_error_event(local_cluster):
    c = local_cluster
    c.decode.mode = "fail_mid_stream"
    async with c.http.post(c.url + "/v1/responses", json={"model": MODEL_ID, "input": "hi", "stream": True}) as r:
        status, raw = r.status, (await r.read()).decode()
    assert status == 200  # the headers went out before the failure
    last = json.loads(raw.strip().split("\n\n")[-1].split("data: ", 1)[1])
    assert last["type"] == "error" and last["code"] and last["message"]
    assert "response.completed" not in raw



# ---- Codex CLI: its captured first request (tests/support/data/agents), as it sends it ----

AGENTS = ROOT / "tests" / "support" / "data" / "agents"
# qwen3-coder calling one of Codex's namespace functions by the flat name it was shown.
SPAWN = ("<tool_call>\n<function=multi_agent_v1__spawn_agent>\n<parameter=message>\nfind the bug\n</parameter>\n"
         "</function>\n</tool_call>")
EXEC = "<tool_call>\n<function=exec_command>\n<parameter=cmd>\nls\n</parameter>\n</function>\n</tool_call>"


def _codex_body() -> dict:
    return json.loads((AGENTS / "codex_exec_first_turn.json").read_text())["body"]


@pytest.fixture
async def coder(tmp_path, empty_config):
    """A qwen3_moe-family fake cluster with room for Codex's ~40 KB of instructions and tools."""
    folder = write_family_tokenizer(tmp_path / "qwen3_moe", "qwen3_moe")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    c = await Cluster(n_prefill=0, model_dir=folder, max_model_len=131072).start()
    c.decode.speak(folder, SPAWN)
    yield c, folder
    await c.stop()


def _strict(model) -> None:
    assert not _extras(model, type(model).__name__), _extras(model, type(model).__name__)


async def _post_streamed(client: openai.AsyncOpenAI, body: dict) -> tuple[list, Response]:
    """Post `body` as it is and read the SSE stream with the SDK's own event types, each strictly."""
    stream = await client.post("/responses", body=body, cast_to=Response, stream=True,
                               stream_cls=openai.AsyncStream[ResponseStreamEvent])
    events = [ev async for ev in stream]
    for ev in events:
        _strict(ev)
    assert events[-1].type == "response.completed", [e.type for e in events]
    return events, events[-1].response


async def test_codex_first_request_is_served(coder, caplog):
    """Codex CLI 0.169.0's first request (13 tools: a `namespace` of sub-agent functions, a hosted `web_search`;
    `developer` messages; `include`, `prompt_cache_key`, `client_metadata`): answered, and a call to a namespace's
    function comes back as `name` + `namespace`, as OpenAI's `ResponseFunctionToolCall` and Codex read it."""
    (c, _), body = coder, _codex_body()
    assert body["stream"] is True and {t["type"] for t in body["tools"]} == {"function", "namespace", "web_search"}
    client = _client(c)
    with caplog.at_level("WARNING"):
        events, final = await _post_streamed(client, body)
    assert "web_search" in caplog.text  # the hosted tool is dropped, and the log says so
    prompt = c.decode.tok.decode(c.decode.requests[-1]["token_ids"], skip_special_tokens=False)
    assert "You are a coding agent running in the Codex CLI" in prompt  # developer messages, as system
    assert "What is the capital of France?" in prompt
    for name in ("exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__close_agent", "update_goal"):
        assert f"<name>{name}</name>" in prompt, name
    assert "external_web_access" not in prompt
    (call,) = final.output
    assert call.type == "function_call" and (call.namespace, call.name) == ("multi_agent_v1", "spawn_agent")
    assert json.loads(call.arguments) == {"message": "find the bug"} and final.status == "completed"
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.namespace, i.name) for i in added] == [("multi_agent_v1", "spawn_agent")]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.namespace, i.name) for i in done] == [("multi_agent_v1", "spawn_agent")]
    assert [t.type for t in final.tools] == [t["type"] for t in body["tools"]]  # echoed as sent

    # Codex's next turn sends the call back (with its namespace) and the tool's output; store is false as before.
    body["input"] += [call.model_dump(exclude_none=True),
                      {"type": "function_call_output", "call_id": call.call_id, "output": "agent 7 started"}]
    _, final = await _post_streamed(client, body)
    prompt = c.decode.tok.decode(c.decode.requests[-1]["token_ids"], skip_special_tokens=False)
    assert prompt.count("<function=multi_agent_v1__spawn_agent>") == 1 and "agent 7 started" in prompt
    await client.close()


async def test_codex_request_answered_whole(coder):
    """The same body asked whole: a strictly typed `Response`; a plain function's call carries no namespace."""
    (c, folder), body = coder, {**_codex_body(), "stream": False}
    c.decode.speak(folder, EXEC)
    client = _client(c)
    r = await client.post("/responses", body=body, cast_to=Response)
    _strict(r)
    (call,) = r.output
    assert (call.name, call.namespace, json.loads(call.arguments)) == ("exec_command", None, {"cmd": "ls"})
    await client.close()


async def test_codex_on_a_model_without_tools_is_a_clear_400(local_cluster):
    """The embedded SmolLM2's template renders no tools: Codex's request gets a 400 that says so, in OpenAI's
    shape, before any stream opens (what `codex exec` prints against `make serve`)."""
    client = _client(local_cluster)
    with pytest.raises(openai.BadRequestError) as e:
        await client.post("/responses", body={**_codex_body(), "model": MODEL_ID}, cast_to=Response, stream=True,
                          stream_cls=openai.AsyncStream[ResponseStreamEvent])
    assert e.value.body["param"] == "tools" and "does not support tools" in e.value.body["message"]
    await client.close()
