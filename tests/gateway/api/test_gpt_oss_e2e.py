"""The tiny gpt_oss checkpoint (family tokenizer, gpt-oss chat template) on a real decode node (mlx-cpu) behind the
real gateway: both APIs render the harmony prompt with the reasoning effort, and generation stops on harmony's
end tokens <|return|> and <|call|> (config.json names only one as EOS). A random model emits no harmony by itself:
logit_bias makes it say the end token; the parsing itself is tested with real token streams in
test_reasoning_api.py and test_toolcalls_api.py. A forced tool call (tool_choice) is masked into a valid harmony
call by the decode node's grammar. On the shared tiny-gpt_oss stack (tests/support/oss_fixtures.py)."""

from __future__ import annotations

import json

import pytest

from tests.support.stack import MODEL_ID, Stack
from tests.support.e2e import post as e2e_post

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def oss(oss_stack):
    """(the shared stack, its tokenizer's added tokens by text)."""
    ids = json.loads((oss_stack.folder / "tokenizer.json").read_text())["added_tokens"]
    return oss_stack.stack, {t["content"]: t["id"] for t in ids}


def post(s: Stack, path: str, body: dict) -> tuple[int, dict]:
    status, _, got = e2e_post(s.url("gateway") + path, body)  # checked against openai's / ollama's types
    return status, got


@pytest.mark.parametrize("end", ["<|return|>", "<|call|>"])
def test_generation_stops_on_harmony_end_tokens(oss, end):
    s, ids = oss
    status, body = post(s, "/v1/chat/completions", {
        "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0,
        "reasoning_effort": "high", "logit_bias": {str(ids[end]): 100}})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["message"]["content"] == ""  # the end token's text is not sent


def harmony_ids(s: Stack, **kwargs) -> list[int]:
    """The prompt as transformers renders the checkpoint's gpt-oss chat template (the independent reference)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(s.settings.models[0].path))
    return tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False, **kwargs)


def test_both_apis_answer_with_the_harmony_template(oss):
    """Each API's prompt is the gpt-oss template's rendering, with the reasoning effort its request names."""
    s, _ = oss
    status, body = post(s, "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 6, "temperature": 0,
                                                    "messages": [{"role": "user", "content": "hi"}],
                                                    "reasoning_effort": "high"})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
    assert body["usage"]["prompt_tokens"] == len(harmony_ids(s, reasoning_effort="high"))
    assert "reasoning_content" in body["choices"][0]["message"]  # the model's family splits reasoning
    status, body = post(s, "/api/chat", {"model": MODEL_ID, "stream": False, "think": "low",
                                         "messages": [{"role": "user", "content": "hi"}],
                                         "options": {"num_predict": 6, "temperature": 0}})
    assert status == 200 and body["done"] and body["eval_count"] >= 1, body
    assert body["prompt_eval_count"] == len(harmony_ids(s, reasoning_effort="low"))
    status, body = post(s, "/api/generate", {"model": MODEL_ID, "stream": False, "prompt": "hi", "think": "high",
                                             "options": {"num_predict": 6, "temperature": 0}})
    assert status == 200 and body["done"], body
    # /api/generate's context starts with the prompt's token ids: the template's with that effort, exactly (the
    # efforts differ in one token, so the lengths above cannot tell them apart)
    assert body["context"][:body["prompt_eval_count"]] == harmony_ids(s, reasoning_effort="high")


def test_forced_tool_call_is_masked_into_harmony(oss):
    """tool_choice names a function: the decode node masks by the gateway's harmony call grammar, so even a random
    model answers with that call and arguments valid for its schema. The analysis channel the grammar allows first
    is biased away here (a random model would fill it until max_tokens)."""
    s, _ = oss
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(s.settings.models[0].path) + "/tokenizer.json").get_vocab()
    no_analysis = {str(i): -100 for t, i in vocab.items() if t and "analysis".startswith(t)
                   and not "commentary".startswith(t)}
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object",
        "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["unit", "days"], "additionalProperties": False}}} for name in ("get_weather", "set_unit")]
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 60,
            "temperature": 0, "logit_bias": no_analysis}
    for choice, names in [({"type": "function", "function": {"name": "set_unit"}}, {"set_unit"}),
                          ("required", {"get_weather", "set_unit"})]:
        status, out = post(s, "/v1/chat/completions", {**body, "tool_choice": choice})
        assert status == 200, out
        c = out["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        (call,) = c["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] in names and args["unit"] in ("c", "f") and 0 <= args["days"] <= 9, call
