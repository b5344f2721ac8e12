"""Out-of-range or unsupported OpenAI parameters: a 400 OpenAI error whose `param` names the field, and no work
reaches a node."""

from __future__ import annotations

import pytest

from tests.support.fakes import MODEL_ID, REPLY, Cluster, chat_body
from kv_bridge.protocol import SEED_SPACE, Sampling

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

BOTH = [
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": 9}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # SmolLM2's vocabulary has 49152 ids
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"seed": 1.5}, "seed"),
    ({"temperature": 2.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
]

CHAT_ONLY = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
]

COMPLETIONS_ONLY = [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [-1, 5]}, "prompt"),
    ({"prompt": [49152]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": [{"text": "x"}]}, "prompt"),
]


def body_for(path: str, patch: dict) -> dict:
    base = chat_body("hi") if path == CHAT else {"model": MODEL_ID, "prompt": "hi"}
    return {k: v for k, v in {**base, **patch}.items() if v is not None}


async def assert_400(c: Cluster, path: str, patch: dict, param: str) -> dict:
    status, _, resp = await c.post(path, body_for(path, patch))
    assert status == 400, resp
    err = resp["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert c.decode.requests == [] and c.prefill.requests == []
    return err


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("patch", "param"), BOTH)
async def test_invalid_on_both(cluster, path, patch, param):
    await assert_400(cluster, path, patch, param)


@pytest.mark.parametrize(("patch", "param"), CHAT_ONLY)
async def test_invalid_chat(cluster, patch, param):
    await assert_400(cluster, CHAT, patch, param)


@pytest.mark.parametrize(("patch", "param"), COMPLETIONS_ONLY)
async def test_invalid_completions(cluster, patch, param):
    await assert_400(cluster, COMPLETIONS, patch, param)


async def test_messages_say_why(cluster):
    err = await assert_400(cluster, CHAT, {"response_format": {"type": "json_schema"}}, "response_format.json_schema")
    assert "json_schema" in err["message"] and "schema" in err["message"]
    err = await assert_400(cluster, CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools")
    assert "does not support tools" in err["message"]
    err = await assert_400(cluster, COMPLETIONS, {"echo": True}, "echo")
    assert "not supported" in err["message"]


def sent(c: Cluster) -> Sampling:
    """The sampling the decode node parses from the last request it got (its own boundary parser)."""
    return Sampling.from_json(c.decode.requests[-1])


# Each edge value and what the decode node must sample with for it.
EDGES = [
    ({"top_k": 0}, "top_k", 0), ({"min_p": 0}, "min_p", 0.0), ({"min_p": 1}, "min_p", 1.0),
    ({"presence_penalty": -2}, "presence_penalty", -2.0), ({"frequency_penalty": 2}, "frequency_penalty", 2.0),
    ({"repetition_penalty": 0.01}, "repetition_penalty", 0.01),
    ({"logit_bias": {"0": -100, "49151": 100}}, "logit_bias", {0: -100.0, 49151: 100.0}),
    ({"seed": -3}, "seed", -3 % SEED_SPACE), ({"logit_bias": {}}, "logit_bias", {}), ({"stop": "x"}, "stop", ["x"]),
    ({"response_format": {"type": "text"}}, "grammar", None),
]


@pytest.mark.parametrize(("patch", "field", "want"), EDGES)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_edges_accepted(cluster, path, patch, field, want):
    status, _, resp = await cluster.post(path, body_for(path, patch))
    assert status == 200, resp
    assert getattr(sent(cluster), field) == want


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_n_16_is_accepted_as_16_generations(cluster, path):
    status, _, resp = await cluster.post(path, body_for(path, {"n": 16}))
    assert status == 200, resp
    assert len(resp["choices"]) == 16 and len(cluster.decode.requests) == 16


@pytest.mark.parametrize(("patch", "want"), [({"logprobs": True, "top_logprobs": 20}, 20),
                                             ({"logprobs": False, "top_logprobs": 0}, None)])
async def test_chat_logprobs_edges_reach_the_node(cluster, patch, want):
    status, _, resp = await cluster.chat(body_for(CHAT, patch))
    assert status == 200, resp
    assert sent(cluster).logprobs == want
    assert (resp["choices"][0]["logprobs"] is None) == (want is None)


@pytest.mark.parametrize("patch", [{"tool_choice": "none"}, {"tool_choice": "auto"}, {"parallel_tool_calls": False}])
async def test_tool_choice_without_tools_is_a_plain_answer(cluster, patch):
    status, _, resp = await cluster.chat(body_for(CHAT, patch))
    assert status == 200, resp
    assert sent(cluster).grammar is None
    assert resp["choices"][0]["message"]["content"] == REPLY and resp["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("patch", "check"), [
    ({"logprobs": 20},
     lambda c, r: sent(c).logprobs == 20 and len(r["choices"][0]["logprobs"]["top_logprobs"][0]) == 20),
    ({"logprobs": 0}, lambda c, r: sent(c).logprobs == 0 and r["choices"][0]["logprobs"] is not None),
    ({"echo": False}, lambda c, r: r["choices"][0]["text"] == REPLY),
    ({"suffix": ""}, lambda c, r: r["choices"][0]["text"] == REPLY),
    ({"best_of": 2, "n": 2}, lambda c, r: len(r["choices"]) == 2 and len(c.decode.requests) == 2),
    ({"prompt": [[5, 6]]}, lambda c, r: c.decode.requests[-1]["token_ids"] == [5, 6]),
], ids=["logprobs-20", "logprobs-0", "echo-false", "suffix-empty", "best_of-n", "token-prompt"])
async def test_completions_edges_accepted(cluster, patch, check):
    status, _, resp = await cluster.post(COMPLETIONS, body_for(COMPLETIONS, patch))
    assert status == 200, resp
    assert check(cluster, resp), (resp, cluster.decode.requests[-1])


async def test_completions_context_length(empty_config):
    c = await Cluster(max_model_len=16).start()
    try:
        status, _, body = await c.post(COMPLETIONS, {"model": MODEL_ID, "prompt": list(range(10)), "max_tokens": 7})
        assert status == 400 and body["error"]["param"] == "prompt"
        assert body["error"]["code"] == "context_length_exceeded"
        status, _, body = await c.post(COMPLETIONS, {"model": MODEL_ID, "prompt": list(range(10))})
        assert status == 200 and c.decode.requests[-1]["max_tokens"] == 6  # the default 16 shrinks to fit
    finally:
        await c.stop()


async def test_completions_unknown_model(cluster):
    status, _, body = await cluster.post(COMPLETIONS, {"model": "nope", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("fmt", "grammar"), [
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
     {"type": "json_schema", "schema": SCHEMA, "strict": True}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
     {"type": "json_schema", "schema": SCHEMA, "strict": False}),
    ({"type": "text"}, None),
])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_response_format_reaches_the_decode_node(cluster, path, fmt, grammar):
    status, _, resp = await cluster.post(path, body_for(path, {"response_format": fmt}))
    assert status == 200, resp
    assert cluster.decode.requests[-1]["grammar"] == grammar
    assert cluster.decode.requests[-1]["grammar_generated"] == 0
