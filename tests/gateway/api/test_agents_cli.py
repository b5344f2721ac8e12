"""Codex CLI and Claude Code, unchanged (the versions package.json pins, installed by `make tools`), run a whole tool
loop against the real gateway: the agent asks; a scripted decode node answers in the model family's own output format
(gpt-oss harmony, Qwen3-Coder's XML) with a call to one of the agent's tools; the agent runs it in a scratch folder
and sends the result back; the model answers with final text. Each test checks the file the agent changed, the final
answer, and what reached the model (the tool's result; gpt-oss's reasoning kept across the tool turns).

Quick tier: no engine starts (the in-process fake cluster); each test runs one CLI process, about 1-2 s. A proxy in
front of the gateway records the requests; DISAGG_CAPTURE_AGENTS=DIR writes them as tests/support/data/agents keeps them
(the *_tool_loop.json fixtures, replayed without the CLIs by test_agents_replay.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support import agent_clis
from tests.support.fakes import Cluster
from tests.support.recording_proxy import RecordingProxy
from tests.support.tiny_models import write_family_tokenizer

# Names the agents send for the fake cluster's one model (config.toml's aliases, as a site names them).
NAMES = {"gpt_oss": "gpt-oss:120b", "qwen3_moe": "qwen3-coder:30b"}
CAPTURE = os.environ.get("DISAGG_CAPTURE_AGENTS")


async def _cluster(tmp_path: Path, family: str) -> tuple[Cluster, RecordingProxy]:
    folder = write_family_tokenizer(tmp_path / family, family)
    (folder / "config.json").write_text(json.dumps({"model_type": family}))
    c = await Cluster(n_prefill=0, model_dir=folder, max_model_len=131072,
                      route={"aliases": [NAMES[family]]}).start()
    c.decode.speak(folder, "")
    return c, RecordingProxy(c.url)


def _prompts(c: Cluster) -> list[str]:
    return [c.decode.tok.decode(r["token_ids"], skip_special_tokens=False) for r in c.decode.requests]


def _capture(proxy: RecordingProxy, name: str, scratch: Path) -> None:
    """The loop's last request (it holds the whole conversation) as a fixture, when DISAGG_CAPTURE_AGENTS says where."""
    if CAPTURE:
        (path, body), headers = proxy.posted[-1], proxy.headers[-1]
        out = agent_clis.fixture(path, body, headers, scratch)
        Path(CAPTURE, f"{name}.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


def _scratch(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("color = red\n")
    return work


# ---- a scripted model: each turn a step, written in the family's own output format ----

# A step: (reasoning, tool name, arguments) for a call, (reasoning, None, final text) for the answer.
Step = tuple[str, str | None, "dict | str"]
RESULT_MARK = {"gpt_oss": "to=assistant<|channel|>commentary<|message|>", "qwen3_moe": "<tool_response>"}


def _say(family: str, step: Step) -> str:
    reasoning, name, what = step
    if family == "gpt_oss":
        head = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>"
        if name is None:
            return head + f"final<|message|>{what}"
        return head + f"commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(what)}"
    if name is None:
        return what
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in what.items())
    return f"{reasoning}\n<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _script(family: str, steps: list[Step]):
    """The decode node's answer to a prompt: the step after as many tool results as the prompt holds."""
    return lambda prompt: _say(family, steps[min(prompt.count(RESULT_MARK[family]), len(steps) - 1)])


# ---- Codex CLI: /v1/responses, streaming, store false ----

PATCH = "*** Begin Patch\n*** Update File: notes.txt\n@@\n-color = red\n+color = blue\n*** End Patch\n"
FINAL = "notes.txt now says color = blue."
CODEX = [("The user wants blue; patch notes.txt with apply_patch.", "exec_command",
          {"cmd": f"apply_patch <<'EOF'\n{PATCH}EOF"}),
         ("The patch applied.", None, FINAL)]


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
async def test_codex_patches_a_file_through_a_tool_call(tmp_path, empty_config, family):
    """Codex calls its exec_command tool with an apply_patch script (which Codex runs itself, as for any model),
    sends the output back (with the reasoning item, store false), and prints the final answer."""
    c, proxy = await _cluster(tmp_path, family)
    work = _scratch(tmp_path)
    c.decode.script = _script(family, CODEX)
    try:
        rc, out, err = await agent_clis.codex("Make the color in notes.txt blue.", f"http://127.0.0.1:{proxy.port}",
                                              NAMES[family], work, tmp_path / "home")
        _capture(proxy, f"codex_exec_tool_loop_{family}", tmp_path)
    finally:
        proxy.close()
        await c.stop()
    assert rc == 0, (out, err)
    assert (work / "notes.txt").read_text() == "color = blue\n"
    assert out.strip().splitlines()[-1] == FINAL, (out, err)
    bodies = proxy.bodies("/v1/responses")
    assert len(bodies) == len(c.decode.requests) == 2 and all(b["stream"] and b["store"] is False for b in bodies)
    first, second = _prompts(c)
    assert "Success. Updated the following files:" in second and "exec_command" in first
    # Turn 1's output items come back: gpt-oss's analysis as a reasoning item, qwen3-coder's text as a message.
    sent = [i["type"] for i in bodies[1]["input"][len(bodies[0]["input"]):]]
    assert sent == ["reasoning" if family == "gpt_oss" else "message", "function_call", "function_call_output"]
    if family == "gpt_oss":  # the reasoning item Codex sent back, rendered before the call it led to
        assert (f"<|start|>assistant<|channel|>analysis<|message|>{CODEX[0][0]}<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.exec_command") in second
    opening = "<|start|>assistant" if family == "gpt_oss" else "<|im_start|>assistant"
    assert second.startswith(first[:first.rindex(opening)])  # the same conversation, grown by the tool turn


# ---- Claude Code: /v1/messages, streaming, tool_use / tool_result, thinking blocks ----

def _claude_steps(path: Path) -> list[Step]:
    return [("Read the file first.", "Read", {"file_path": str(path)}),
            ("It says red; edit it.", "Edit", {"file_path": str(path), "old_string": "color = red",
                                                "new_string": "color = blue"}),
            ("Check it on disk.", "Bash", {"command": f"cat {path}", "description": "Show notes.txt"}),
            ("The edit is done.", None, FINAL)]


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
async def test_claude_code_reads_edits_and_runs_a_command(tmp_path, empty_config, family):
    """Claude Code reads the file (its Edit tool refuses a file it has not read), edits it, shows it with a shell
    command, and prints the final answer: four requests, each carrying the previous tool's result."""
    c, proxy = await _cluster(tmp_path, family)
    notes = _scratch(tmp_path) / "notes.txt"
    steps = _claude_steps(notes)
    c.decode.script = _script(family, steps)
    try:
        rc, out, err = await agent_clis.claude("Make the color in notes.txt blue.", f"http://127.0.0.1:{proxy.port}",
                                               NAMES[family], notes.parent, tmp_path / "home", "Read,Edit,Bash")
        _capture(proxy, f"claude_code_tool_loop_{family}", tmp_path)
    finally:
        proxy.close()
        await c.stop()
    assert rc == 0, (out, err)
    assert notes.read_text() == "color = blue\n"
    assert out.strip() == FINAL, (out, err)
    bodies = proxy.bodies("/v1/messages?beta=true")
    assert len(bodies) == len(c.decode.requests) == 4 and all(b["stream"] for b in bodies)
    prompts = _prompts(c)
    assert "color = red" in prompts[1] and "has been updated successfully" in prompts[2]
    assert "color = blue" in prompts[3]  # the shell command's output
    if family == "gpt_oss":  # thinking blocks sent back, each rendered before its call
        assert [b["type"] for b in bodies[2]["messages"][-2]["content"]] == ["thinking", "tool_use"]
        for (reasoning, name, _), prompt in zip(steps[:3], prompts[1:]):
            assert (f"<|start|>assistant<|channel|>analysis<|message|>{reasoning}<|end|>"
                    f"<|start|>assistant<|channel|>commentary to=functions.{name}") in prompt
