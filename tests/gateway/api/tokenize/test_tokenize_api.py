"""vLLM's /tokenize and /detokenize on the gateway: requests built as vLLM's own pydantic types, answers read by them.
Chat messages count exactly the prompt /v1/chat/completions sends the node; a prompt counts as transformers does."""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import MODEL_DIR, MODEL_ID, Cluster
from tests.support.family_streams import family_tokenizers
from tests.support.tiny_models import write_family_tokenizer

import vllm.entrypoints.serve.tokenize.protocol as vllm_tokenize

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
LOOP = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Call the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def body(req) -> dict:
    """A vLLM request object as the JSON a client sends."""
    return req.model_dump(mode="json", exclude_none=True)


async def test_chat_messages_count_what_a_chat_request_sends(tmp_path, empty_config):
    folder = write_family_tokenizer(tmp_path / "gpt_oss", "gpt_oss")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    c = await Cluster(n_prefill=0, model_dir=folder).start()
    try:
        req = vllm_tokenize.TokenizeChatRequest(model=MODEL_ID, messages=LOOP, tools=TOOLS, return_token_strs=True)
        status, _, out = await c.post("/tokenize", body(req))
        assert status == 200, out
        r = vllm_tokenize.TokenizeResponse.model_validate(out)
        await c.chat({"model": MODEL_ID, "messages": LOOP, "tools": TOOLS, "max_tokens": 4})
        assert r.tokens == c.decode.requests[-1]["token_ids"] and r.count == len(r.tokens)
        assert r.max_model_len == c.settings.models[0].max_model_len
        hf, _ = family_tokenizers("gpt_oss", str(tmp_path / "ref"))
        assert r.token_strs == hf.convert_ids_to_tokens(r.tokens)
        assert "Call the tool." in hf.decode(r.tokens)  # the tool-call turn's analysis is counted too
    finally:
        await c.stop()


async def test_prompt_and_detokenize_as_transformers(local_cluster):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    text = "The capital of France is Paris. ünïcødé ✓"
    for special in (True, False):
        req = vllm_tokenize.TokenizeCompletionRequest(prompt=text, add_special_tokens=special)  # model left out
        status, _, out = await local_cluster.post("/tokenize", body(req))
        assert status == 200, out
        r = vllm_tokenize.TokenizeResponse.model_validate(out)
        assert r.tokens == hf(text, add_special_tokens=special)["input_ids"] and r.token_strs is None
    chat = [{"role": "user", "content": "hi"}]
    status, _, out = await local_cluster.post("/tokenize", {"model": MODEL_ID, "messages": chat,
                                                            "add_generation_prompt": False})
    assert out["tokens"] == hf.apply_chat_template(chat, add_generation_prompt=False, tokenize=True,
                                                   return_dict=False)
    req = vllm_tokenize.DetokenizeRequest(model=MODEL_ID, tokens=r.tokens)
    status, _, out = await local_cluster.post("/detokenize", body(req))
    assert status == 200, out
    assert vllm_tokenize.DetokenizeResponse.model_validate(out).prompt == hf.decode(r.tokens) == text


@pytest.mark.parametrize("path, payload, status, param", [
    ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/tokenize", {"model": MODEL_ID}, 400, "prompt"),
    ("/tokenize", {"model": MODEL_ID, "messages": []}, 400, "messages"),
    ("/tokenize", {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     400, "chat_template"),
    ("/detokenize", {"model": MODEL_ID, "tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL_ID, "tokens": "12"}, 400, "tokens"),
])
async def test_bad_requests_answer_in_openai_shape(local_cluster, path, payload, status, param):
    import openai
    got, _, out = await local_cluster.post(path, payload)
    assert got == status, out
    err = openai.types.ErrorObject.model_validate(out["error"])
    assert err.param == param and err.message
