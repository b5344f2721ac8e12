"""A two-step tool loop on the tiny gpt_oss model (real decode node, mlx-cpu; real gateway): step 1's answer is an
analysis and a call; the client sends both back with the tool's result, on OpenAI's chat API and on Ollama's
/api/chat, and the prompt that reaches the decode node (recorded by a proxy in front of it) carries step 1's
analysis before the call, token for token what transformers renders from the published template's `thinking`.
The stack is the shared tiny-gpt_oss one (tests/support/oss_fixtures.py), whose gateway reaches decode-0 through that proxy.

A random model does not reason or call by itself: tool_choice masks step 1 into a harmony call (the decode node's
grammar allows an analysis first) and logit_bias steers it into a short analysis (the "analysis" channel, then
<|end|>). Ollama's API has neither knob, so its loop continues from the OpenAI client's step 1.
"""

from __future__ import annotations

import json

import pytest

from tests.support.family_streams import family_tokenizers
from tests.support.recording_proxy import RecordingProxy
from tests.support.stack import MODEL_ID, Stack

pytestmark = pytest.mark.e2e

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}]
USER = {"role": "user", "content": "Weather in Paris?"}
RESULT = "sunny, 21 C"


@pytest.fixture(scope="module")
def loop(oss_stack):
    """(stack, proxy, model folder) of the shared stack: its gateway reaches decode-0 through the recording proxy."""
    return oss_stack.stack, oss_stack.proxy, oss_stack.folder


def step_one(s: Stack, folder) -> dict:
    """Step 1 through the openai client: the assistant message it returns, as a client appends it to history."""
    import openai
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab()
    bias = {str(i): 100 for t, i in vocab.items() if t and "analysis".startswith(t) and not "commentary".startswith(t)}
    bias[str(tok.token_to_id("<|end|>"))] = 100
    client = openai.OpenAI(base_url=s.url("gateway") + "/v1", api_key="unused")
    r = client.chat.completions.create(model=MODEL_ID, messages=[USER], tools=TOOLS, temperature=0, max_tokens=40,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       logit_bias=bias)
    client.close()
    assert r.choices[0].finish_reason == "tool_calls", r
    msg = r.choices[0].message.model_dump(exclude_none=True)
    assert msg.get("reasoning_content") and msg["tool_calls"][0]["function"]["name"] == "get_weather", msg
    return msg


def published(analysis: str, call: dict) -> list[dict]:
    """Step 2's history as the published gpt-oss template reads it."""
    fn = call["function"]
    return [USER, {"role": "assistant", "content": "", "thinking": analysis, "tool_calls": [
        {"type": "function", "function": {"name": fn["name"], "arguments": json.loads(fn["arguments"])}}]},
            {"role": "tool", "name": fn["name"], "content": RESULT}]


def check_prompt(proxy: RecordingProxy, folder, analysis: str, call: dict) -> None:
    ids = proxy.bodies("/v1/generate")[-1]["token_ids"]
    hf, _ = family_tokenizers("gpt_oss", str(folder.parent / "ref"))
    text = hf.decode(ids)
    assert (f"<|start|>assistant<|channel|>analysis<|message|>{analysis}<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather") in text, text
    assert ids == hf.apply_chat_template(published(analysis, call), tools=TOOLS, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_openai_tool_loop_sends_the_analysis_back(loop):
    s, proxy, folder = loop
    import openai
    msg = step_one(s, folder)
    call = msg["tool_calls"][0]
    client = openai.OpenAI(base_url=s.url("gateway") + "/v1", api_key="unused")
    history = [USER, msg, {"role": "tool", "tool_call_id": call["id"], "content": RESULT}]
    r = client.chat.completions.create(model=MODEL_ID, messages=history, tools=TOOLS, temperature=0, max_tokens=4)
    client.close()
    assert r.usage.prompt_tokens == len(proxy.bodies("/v1/generate")[-1]["token_ids"])
    check_prompt(proxy, folder, msg["reasoning_content"], call)


def test_ollama_tool_loop_sends_the_thinking_back(loop):
    s, proxy, folder = loop
    import ollama
    msg = step_one(s, folder)
    call = msg["tool_calls"][0]
    fn = call["function"]
    history = [USER, {"role": "assistant", "content": "", "thinking": msg["reasoning_content"], "tool_calls": [
        {"function": {"name": fn["name"], "arguments": json.loads(fn["arguments"])}}]},
               {"role": "tool", "tool_name": fn["name"], "content": RESULT}]
    r = ollama.Client(host=s.url("gateway")).chat(MODEL_ID, messages=history, tools=TOOLS,
                                                  options={"num_predict": 4, "temperature": 0})
    assert r.done and r.prompt_eval_count == len(proxy.bodies("/v1/generate")[-1]["token_ids"])
    check_prompt(proxy, folder, msg["reasoning_content"], call)
