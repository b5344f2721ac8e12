"""Speculative decoding through the whole split: a decode node with prompt lookup on, behind its own gateway and the
session stack's prefill node (bridged KV), answers greedy chat and JSON-mode requests token for token as the session
stack's plain decode node does, and its /metrics show the verify steps it ran. With a reasoning model's parser: the
scripted tiny gpt_oss with speculation on answers as the shared tiny-gpt_oss stack's plain node does, reasoning and
JSON after it (drafting past its 16-token window: the rollback cache; tests/backends/decode/speculative/
test_speculative_lossless.py checks it token for token in-process)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.support.fakes import sample_value
from tests.support.oss_fixtures import SCRIPTED_ID
from tests.support.stack import MODEL_ID, Stack

pytestmark = pytest.mark.e2e

CODE = "def area(width, height):\n    return width * height\n\ndef perimeter(width, height):\n" \
       "    return width + height\n"
SPEC = '\n[models.speculative]\nmethod = "prompt_lookup"\nnum_draft = 4\nadaptive = false\n'


@pytest.fixture(scope="module")
def spec_stack(stack, tmp_path_factory):
    """Its own decode node (speculation on for the model) and gateway over the session stack's prefill node, whose
    node secret it shares; no canary (its subject is elsewhere: test_fidelity_e2e)."""
    s = Stack(tmp_path_factory.mktemp("spec"), node_secret=stack.settings.auth.node_secret.get_secret_value(),
              prefill_port=stack.settings.node("prefill-0").port, fidelity=False, min_disagg_tokens=3)
    s.config.write_text(s.config.read_text() + SPEC)  # [models.speculative] of the last (only) [[models]]
    with s.running(["decode-0", "gateway"]):
        yield s


def chat(url: str, body: dict) -> tuple[dict, dict]:
    body = {"model": MODEL_ID, "temperature": 0, **body}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read()), dict(r.headers)


def metric(s: Stack, name: str, **labels) -> float:
    req = urllib.request.Request(s.url("decode-0") + "/metrics", headers=s.node_headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return sample_value(r.read().decode(), name, **labels) or 0.0


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": f"Student's code:\n{CODE}\nFirst quote the student's code in a "
                                              "```python block, then grade it."}], "max_tokens": 32},
    {"messages": [{"role": "user", "content": f"Describe this code as JSON with keys name and bug:\n{CODE}"}],
     "max_tokens": 24, "response_format": {"type": "json_object"}},
], ids=["quoting", "json_mode"])
def test_split_with_speculation_equals_plain_decoding(stack, spec_stack, body):
    runs = metric(spec_stack, "disagg_decode_spec_generations_total", model=MODEL_ID, path="speculative")
    got, headers = chat(spec_stack.url("gateway"), body)
    want, _ = chat(stack.url("gateway"), body)
    assert headers["x-disagg-path"] == "disaggregated" and int(headers["x-disagg-kv-tokens"]) > 0
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    assert metric(spec_stack, "disagg_decode_spec_generations_total", model=MODEL_ID, path="speculative") == runs + 1


def test_quoting_answers_are_drafted_and_kept(spec_stack):
    """The requests above ran verify steps, and the target kept drafted tokens (the quoted code)."""
    assert metric(spec_stack, "disagg_decode_spec_steps_total", model=MODEL_ID, kind="verify") > 0
    assert metric(spec_stack, "disagg_decode_spec_accepted_tokens_total", model=MODEL_ID) > 0


def test_bench_spec_switches_speculation_per_request(spec_stack, tmp_path):
    """`disagg bench spec` against the stack (backends/grading/spec.py): each grading-like prompt decoded off and on
    through the gateway; the off requests drafted nothing (x-disagg-speculative reached the node), greedy outputs
    are equal, and the report carries alpha, k and the node's measured step seconds."""
    import argparse

    from backends.grading.spec import run
    from kv_bridge.config.settings import load_config

    args = argparse.Namespace(model=MODEL_ID, requests=2, scale=0.02, num_predict=24, sampled=False, seed=3,
                              url=spec_stack.url("gateway"), api_key=None, timeout=300.0, json=tmp_path / "s.json")
    res = run(load_config(spec_stack.config), args)
    assert res["requests"] == 2 and res["equal_outputs"] == 2
    assert all(r["off"]["drafted"] == 0 and r["off"]["verify"] == 0 for r in res["rows"])
    assert all(r["on"]["verify"] + r["on"]["plain"] > 0 for r in res["rows"])  # on: the speculative path ran
    assert res["decode_tokens_per_s"]["off"] > 0 and res["decode_tokens_per_s"]["on"] > 0
    assert any("rows=1" in k for k in res["step_seconds"])  # the node timed its plain steps


# ---- a reasoning model's parser: the scripted tiny gpt_oss (harmony channels), the decode node's grammar gated ----
# to the final channel; the plain reference is the shared tiny-gpt_oss stack (tests/support/oss_fixtures.py)

@pytest.fixture(scope="module")
def spec_oss(oss_stack, tmp_path_factory):
    """A decode node serving the scripted gpt_oss with prompt lookup on, and its gateway (the local path: the tiny
    gpt_oss has no prefill node here, as on the shared stack)."""
    s = Stack(tmp_path_factory.mktemp("spec-oss"), model_dir=oss_stack.scripted, fidelity=False)
    text = s.config.read_text().replace(f'id = "{s.settings.models[0].id}"', f'id = "{SCRIPTED_ID}"')
    s.config.write_text(text + SPEC)
    with s.running(["decode-0", "gateway"]):
        yield s


@pytest.mark.parametrize("fmt", [None, {"type": "json_schema", "json_schema": {"name": "grade", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}],
    ids=["reasoning", "reasoning_then_json"])
def test_reasoning_parser_with_speculation_equals_plain_decoding(oss_stack, spec_oss, fmt):
    """The gateway's gpt-oss parser splits the same tokens the same way: reasoning_content and content equal the plain
    node's, with JSON after the thinking where asked; the request took the speculative path (and stayed on it: adaptive is
    off here) past the window, drafting where prompt lookup found a match."""
    body = {"model": SCRIPTED_ID, "messages": [{"role": "user", "content": "Grade the notebook. Answer in JSON."}],
            "max_tokens": 40, **({"response_format": fmt} if fmt else {})}
    runs = metric(spec_oss, "disagg_decode_spec_generations_total", model=SCRIPTED_ID, path="speculative")
    got, _ = chat(spec_oss.url("gateway"), body)
    want, _ = chat(oss_stack.stack.url("gateway"), body)
    g, w = got["choices"][0]["message"], want["choices"][0]["message"]
    assert w.get("reasoning_content") and g.get("reasoning_content") == w["reasoning_content"]
    assert g["content"] == w["content"] and got["usage"] == want["usage"]
    if fmt:
        assert isinstance(json.loads(g["content"])["ok"], bool)
    assert metric(spec_oss, "disagg_decode_spec_generations_total", model=SCRIPTED_ID, path="speculative") == runs + 1
    # Past its 16-token window from the prompt on: what it drafted was verified and rolled back past the window
    # (kv_bridge/mlx/cache.py RollbackRotatingKVCache); nothing here went to the batch for want of a trimmable cache
    assert metric(spec_oss, "disagg_decode_spec_generations_total", model=SCRIPTED_ID, path="untrimmable_cache") == 0
