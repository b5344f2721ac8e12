"""gpt-oss reasoning through the real gateway: a fake decode node streams real harmony token sequences (the gpt_oss
family tokenizer's ids, special tokens as text), and the official `openai` and `ollama` clients read the analysis
channel as reasoning_content / thinking and the final channel as content; reasoning_effort and think reach the
chat template."""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import MODEL_ID, Cluster
from tests.support.tiny_models import write_family_tokenizer

ANALYSIS = "The user asks for the capital of France. Easy."
FINAL = "The capital of France is Paris."
# What gpt-oss emits after the prompt's `<|start|>assistant`; the decode node stops on <|return|> (no text).
HARMONY = f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>final<|message|>{FINAL}"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
async def gpt_oss(tmp_path, empty_config):
    folder = write_family_tokenizer(tmp_path / "gpt_oss", "gpt_oss")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    c = await Cluster(n_prefill=0, model_dir=folder).start()
    c.decode.speak(folder, HARMONY)
    yield c
    await c.stop()


def _prompt_text(c: Cluster) -> str:
    return c.decode.tok.decode(c.decode.requests[-1]["token_ids"], skip_special_tokens=False)


async def test_openai_client_reads_reasoning_and_content(gpt_oss):
    import openai
    client = openai.AsyncOpenAI(base_url=gpt_oss.url + "/v1", api_key="unused")
    r = await client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=200,
                                             reasoning_effort="high")
    msg = r.choices[0].message
    assert msg.content == FINAL and msg.reasoning_content == ANALYSIS and msg.reasoning == ANALYSIS
    assert r.choices[0].finish_reason == "stop"
    assert "Reasoning: high" in _prompt_text(gpt_oss)

    stream = await client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=200, stream=True)
    reasoning, content = "", ""
    async for ev in stream:
        for ch in ev.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
            assert not (ch.delta.content and getattr(ch.delta, "reasoning_content", None))  # one part per delta
    assert (reasoning, content) == (ANALYSIS, FINAL)
    await client.close()


async def test_ollama_client_reads_thinking(gpt_oss):
    import ollama
    oc = ollama.AsyncClient(host=gpt_oss.url)
    r = await oc.chat(MODEL_ID, messages=MESSAGES, think="low", options={"num_predict": 200})
    assert r.message.content == FINAL and r.message.thinking == ANALYSIS
    assert "Reasoning: low" in _prompt_text(gpt_oss)
    g = await oc.generate(MODEL_ID, "What is the capital of France?", think=True, options={"num_predict": 200})
    assert g.response == FINAL and g.thinking == ANALYSIS
    parts = [p async for p in await oc.chat(MODEL_ID, messages=MESSAGES, stream=True, options={"num_predict": 200})]
    assert "".join(p.message.content for p in parts) == FINAL
    assert "".join(p.message.thinking or "" for p in parts) == ANALYSIS


async def test_think_on_a_model_without_reasoning_is_a_400(cluster):
    status, _, body = await cluster.post("/api/chat", {"model": MODEL_ID, "messages": MESSAGES, "think": True})
    assert status == 400 and "does not support thinking" in body["error"]
