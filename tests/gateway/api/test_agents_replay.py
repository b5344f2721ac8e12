"""The requests the pinned agent CLIs really send in a tool loop (tests/support/data/agents/*_tool_loop.json: the last request
of test_agents_cli's gpt-oss loops, captured from Codex CLI 0.171.0 and Claude Code 2.1.197), replayed through the
real gateway with a fake gpt-oss decode node, without the CLIs: each turn is accepted, the agent's tools reach the
model, every tool result is in the prompt, and the reasoning the agent sent back is rendered before its call. A
gateway change that breaks what the CLIs send fails here, in the quick tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.fakes import Cluster
from tests.support.oracle import _extras
from tests.support.tiny_models import write_family_tokenizer

import anthropic
import openai
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

AGENTS = Path(__file__).resolve().parents[2] / "support" / "data" / "agents"
ANALYSIS = "<|start|>assistant<|channel|>analysis<|message|>{}<|end|><|start|>assistant<|channel|>commentary to=functions.{}"
FINAL = "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>All done."


def _fixture(name: str) -> dict:
    return json.loads((AGENTS / name).read_text())


@pytest.fixture
async def gpt_oss(tmp_path, empty_config):
    """A gpt_oss-family fake cluster answering to the name both captures sent, with room for their prompts."""
    folder = write_family_tokenizer(tmp_path / "gpt_oss", "gpt_oss")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    c = await Cluster(n_prefill=0, model_dir=folder, max_model_len=131072,
                      route={"aliases": ["gpt-oss:120b"]}).start()
    c.folder = folder
    yield c
    await c.stop()


def _prompt(c: Cluster) -> str:
    return c.decode.tok.decode(c.decode.requests[-1]["token_ids"], skip_special_tokens=False)


def _call(name: str, args: dict) -> str:
    return ("<|channel|>analysis<|message|>Look first.<|end|><|start|>assistant<|channel|>commentary "
            f"to=functions.{name} <|constrain|>json<|message|>{json.dumps(args)}")


async def _responses(c: Cluster, body: dict) -> Response:
    client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.post("/responses", body=body, cast_to=Response, stream=True,
                               stream_cls=openai.AsyncStream[ResponseStreamEvent])
    events = [ev async for ev in stream]
    await client.close()
    assert not [x for ev in events for x in _extras(ev, ev.type)]  # no field the SDK's types lack
    assert events[-1].type == "response.completed", [e.type for e in events]
    return events[-1].response


async def test_codex_tool_loop_request_is_served(gpt_oss):
    """Codex 0.171.0's second request: its whole first turn, the reasoning item and exec_command call it got back,
    and the apply_patch output. Its first turn (the input before the reasoning item) gets a call back."""
    c, fixture = gpt_oss, _fixture("codex_exec_tool_loop.json")
    body = fixture["body"]
    assert "codex_exec/0.171.0" in fixture["captured"]["headers"]["user-agent"]
    assert body["stream"] is True and body["store"] is False and body["model"] == "gpt-oss:120b"
    kinds = [i.get("type") for i in body["input"]]
    cut = kinds.index("reasoning")
    assert kinds[cut:] == ["reasoning", "function_call", "function_call_output"]
    reasoning, call, output = body["input"][cut:]

    c.decode.speak(c.folder, _call("exec_command", {"cmd": "cat notes.txt"}))
    first = await _responses(c, {**body, "input": body["input"][:cut]})
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    assert first.output[1].name == "exec_command" and first.output[1].namespace is None
    for name in ("exec_command", "write_stdin", "multi_agent_v1__spawn_agent", "update_goal"):
        assert f"type {name} = " in _prompt(c), name  # the agent's tools, listed for the model

    c.decode.speak(c.folder, FINAL)
    second = await _responses(c, body)
    assert second.output_text == "All done." and second.status == "completed"
    prompt = _prompt(c)
    assert ANALYSIS.format(reasoning["content"][0]["text"], call["name"]) in prompt
    assert json.dumps(output["output"], ensure_ascii=False) in prompt  # the tool's output, as harmony writes a result (JSON text)
    assert prompt.endswith("<|start|>assistant")


async def _messages(c: Cluster, body: dict) -> Message:
    client = anthropic.AsyncAnthropic(base_url=c.url, api_key="unused", max_retries=0)
    stream = await client.post("/v1/messages?beta=true", body=body, cast_to=Message, stream=True,
                               stream_cls=anthropic.AsyncStream[RawMessageStreamEvent])
    events = [ev async for ev in stream]
    await client.close()
    assert not [x for ev in events for x in _extras(ev, ev.type)]
    assert [events[0].type, events[-1].type] == ["message_start", "message_stop"]
    blocks: dict[int, dict] = {}
    stop = None
    for ev in events:
        if ev.type == "content_block_start":
            blocks[ev.index] = ev.content_block.model_dump()
        elif ev.type == "content_block_delta" and ev.delta.type in ("text_delta", "thinking_delta"):
            key = "text" if ev.delta.type == "text_delta" else "thinking"
            blocks[ev.index][key] += getattr(ev.delta, key)
        elif ev.type == "message_delta":
            stop = ev.delta.stop_reason
    return Message.model_validate({**events[0].message.model_dump(), "stop_reason": stop,
                                   "content": [b for _, b in sorted(blocks.items())]})


async def test_claude_code_tool_loop_request_is_served(gpt_oss):
    """Claude Code 2.1.197's fourth request: three assistant turns of [thinking, tool_use] (Read, Edit, Bash) and
    their tool_result blocks. Its first turn (the messages before the first assistant turn) gets a tool_use back."""
    c, fixture = gpt_oss, _fixture("claude_code_print_tool_loop.json")
    body = fixture["body"]
    assert fixture["captured"]["headers"]["user-agent"].startswith("claude-cli/2.1.197")
    assert body["stream"] is True and body["model"] == "gpt-oss:120b"
    roles = [m["role"] for m in body["messages"]]
    cut = roles.index("assistant")
    turns = [m for m in body["messages"][cut:] if m["role"] == "assistant"]
    assert [[b["type"] for b in t["content"]] for t in turns] == [["thinking", "tool_use"]] * 3
    assert [t["content"][1]["name"] for t in turns] == ["Read", "Edit", "Bash"]

    c.decode.speak(c.folder, _call("Read", {"file_path": "/tmp/agent/work/notes.txt"}))
    first = await _messages(c, {**body, "messages": body["messages"][:cut]})
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    assert first.content[1].name == "Read"
    for name in ("Read", "Edit", "Bash", "Write"):
        assert f"type {name} = " in _prompt(c), name

    c.decode.speak(c.folder, FINAL)
    last = await _messages(c, body)
    assert [b.type for b in last.content] == ["thinking", "text"] and last.content[1].text == "All done."
    prompt = _prompt(c)
    for turn in turns:
        thinking, use = turn["content"]
        assert ANALYSIS.format(thinking["thinking"], use["name"]) in prompt
    for m in body["messages"][cut:]:
        for b in m["content"] if m["role"] == "user" else []:
            assert json.dumps(b["content"], ensure_ascii=False) in prompt  # each tool_result, as harmony writes a result
