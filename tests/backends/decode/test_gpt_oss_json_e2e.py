"""JSON after thinking on a real decode node (issue 22, item 5): the scripted tiny gpt_oss model
(tests/support/scripted_gpt_oss.py) reasons in the analysis channel, then opens the final channel; with Ollama's
`format` or OpenAI's `response_format` the decode node's grammar starts only there, so the reasoning streams first
(as `thinking` / `reasoning_content`) and the answer is JSON that the grammar closed. Read with the official
`ollama` and `openai` clients. The shared tiny-gpt_oss stack (tests/support/oss_fixtures.py) serves the scripted model as
SCRIPTED_ID."""

from __future__ import annotations

import json

import pytest

from tests.support.oss_fixtures import SCRIPTED_ID as MODEL_ID
from tests.support.scripted_gpt_oss import REASONING

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Grade the notebook. Answer in JSON."}]


@pytest.fixture(scope="module")
def oss(oss_stack):
    """The shared stack; its decode node serves the scripted model as SCRIPTED_ID."""
    return oss_stack.stack


def test_ollama_format_json_thinks_first_then_answers_json(oss):
    import ollama
    client = ollama.Client(host=oss.url("gateway"), timeout=300)
    order, thinking, response = [], "", ""
    for part in client.generate(MODEL_ID, prompt=MESSAGES[0]["content"], format="json", stream=True,
                                options={"temperature": 0, "num_predict": 40}):
        if part.thinking:
            order.append("thinking")
            thinking += part.thinking
        if part.response:
            order.append("response")
            response += part.response
    assert thinking.strip() == REASONING.strip()
    assert order.index("response") > max(i for i, o in enumerate(order) if o == "thinking")
    assert isinstance(json.loads(response), dict) and part.done_reason == "stop"

    r = client.chat(MODEL_ID, messages=MESSAGES, format=SCHEMA, options={"temperature": 0, "num_predict": 40})
    assert r.message.thinking.strip() == REASONING.strip()
    assert isinstance(json.loads(r.message.content)["ok"], bool) and r.done_reason == "stop"


def test_openai_response_format_streams_reasoning_then_json(oss):
    import openai
    client = openai.OpenAI(base_url=oss.url("gateway") + "/v1", api_key="unused", timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "grade", "schema": SCHEMA, "strict": True}}
    stream = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, response_format=fmt, stream=True,
                                            max_tokens=40, temperature=0)
    kinds, reasoning, content, finish = [], "", "", None
    for ev in stream:
        for ch in ev.choices:
            r = getattr(ch.delta, "reasoning_content", None) or ""
            kinds += ["reasoning"] * bool(r) + ["content"] * bool(ch.delta.content)
            reasoning, content = reasoning + r, content + (ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert reasoning.strip() == REASONING.strip() and finish == "stop"
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert isinstance(json.loads(content)["ok"], bool)
