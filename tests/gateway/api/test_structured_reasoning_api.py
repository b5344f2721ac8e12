"""Structured output on a reasoning model through the real gateway (issue 22, item 5): Ollama `format` and OpenAI
`response_format` reach the decode node gated after harmony's final-channel header, so gpt-oss may reason first;
the official clients read the reasoning (streamed first) apart from the JSON answer. The fake decode node streams a
real harmony token sequence; the decode node's masking itself is tested in tests/backends/decode/test_grammar_reasoning.py."""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import MODEL_ID, Cluster
from gateway.text.reasoning import HARMONY_FINAL
from tests.support.tiny_models import write_family_tokenizer

ANALYSIS = "The rubric wants a boolean. The notebook passes."
ANSWER = '{"ok": true}'
HARMONY = f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
MESSAGES = [{"role": "user", "content": "Grade the notebook. Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture
async def gpt_oss(tmp_path, empty_config):
    folder = write_family_tokenizer(tmp_path / "gpt_oss", "gpt_oss")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    c = await Cluster(n_prefill=0, model_dir=folder).start()
    c.decode.speak(folder, HARMONY)
    yield c
    await c.stop()


async def test_ollama_format_json_streams_thinking_then_the_json(gpt_oss):
    import ollama
    oc = ollama.AsyncClient(host=gpt_oss.url)
    order, thinking, content = [], "", ""
    async for part in await oc.generate(MODEL_ID, prompt=MESSAGES[0]["content"], format="json", stream=True,
                                        options={"num_predict": 200}):
        if part.thinking:
            order.append("thinking")
            thinking += part.thinking
        if part.response:
            order.append("response")
            content += part.response
    assert thinking == ANALYSIS and json.loads(content) == {"ok": True}
    assert order.index("response") > max(i for i, o in enumerate(order) if o == "thinking")
    assert gpt_oss.decode.requests[-1]["grammar"] == {"type": "json_object", "after": list(HARMONY_FINAL)}

    r = await oc.chat(MODEL_ID, messages=MESSAGES, format=SCHEMA, options={"num_predict": 200})
    assert r.message.thinking == ANALYSIS and json.loads(r.message.content) == {"ok": True}
    assert gpt_oss.decode.requests[-1]["grammar"]["after"] == list(HARMONY_FINAL)


async def test_openai_parse_reads_the_json_after_the_reasoning(gpt_oss):
    import openai
    import pydantic

    class Grade(pydantic.BaseModel):
        ok: bool

    client = openai.AsyncOpenAI(base_url=gpt_oss.url + "/v1", api_key="unused")
    r = await client.chat.completions.parse(model=MODEL_ID, messages=MESSAGES, response_format=Grade, max_tokens=200)
    msg = r.choices[0].message
    assert msg.parsed == Grade(ok=True) and msg.reasoning_content == ANALYSIS
    sent = gpt_oss.decode.requests[-1]["grammar"]
    assert sent["type"] == "json_schema" and sent["after"] == list(HARMONY_FINAL)
    await client.close()
