"""The OpenAI parameter surface against fake nodes: /v1/completions shapes, parameter passthrough to the decode
node, logprobs shapes, n choices, tools and response_format."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support.fakes import LONG_TEXT, MODEL_DIR, MODEL_ID, REPLY, Cluster, chat_body
from gateway.text.tokenizer import ChatTokenizer

TOK = ChatTokenizer.from_folder(MODEL_DIR)
REPLY_IDS = TOK.encode(REPLY)
PROMPT = "The capital of France is"


def completion_body(prompt=PROMPT, **kw) -> dict:
    return {"model": MODEL_ID, "prompt": prompt, **kw}


def piece(tid: int) -> str:
    return TOK.tokenizer.decode([tid])


def content(events: list) -> dict[int, str]:
    """Streamed chat text per choice index."""
    out: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            out[c["index"]] = out.get(c["index"], "") + (c["delta"].get("content") or "")
    return out


async def test_completions_non_streaming(cluster):
    status, headers, body = await cluster.post("/v1/completions", completion_body(max_tokens=32))
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL_ID and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}]
    ids = TOK.encode_prompt(PROMPT)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 7, "total_tokens": len(ids) + 7}
    gen = cluster.decode.requests[-1]
    assert gen["token_ids"] == ids  # no chat template
    assert headers["x-disagg-path"] == "local"


async def test_completions_default_budget_is_16(cluster):
    await cluster.post("/v1/completions", completion_body())
    assert cluster.decode.requests[-1]["max_tokens"] == 16


@pytest.mark.parametrize("form", ["ids", "one_string", "one_id_list"])
async def test_completions_prompt_forms(cluster, form):
    ids = TOK.encode_prompt(LONG_TEXT)
    prompt = {"ids": ids, "one_string": [LONG_TEXT], "one_id_list": [ids]}[form]
    status, headers, body = await cluster.post("/v1/completions", completion_body(prompt, max_tokens=3))
    assert status == 200, body
    assert cluster.decode.requests[-1]["token_ids"] == ids
    assert body["choices"][0]["text"] == cluster.decode.reply_text(3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert headers["x-disagg-path"] == "disaggregated"


async def test_completions_streaming(cluster):
    body = completion_body(max_tokens=32, stream_options={"include_usage": True})
    status, headers, events = await cluster.events("/v1/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks, last = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 7


SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 42, "stop": ["\n", "END"],
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
            "logit_bias": {"504": -100, "28": 2.5}, "max_tokens": 3}
FORWARDED = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 42, "stop": ["\n", "END"],
             "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
             "logit_bias": {"504": -100.0, "28": 2.5}, "max_tokens": 3}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_sampling_forwarded(cluster, path):
    body = chat_body("hi", **SAMPLING) if "chat" in path else completion_body(**SAMPLING)
    status, _, resp = await cluster.post(path, {**body, "some_future_field": {"x": 1}})
    assert status == 200, resp
    gen = cluster.decode.requests[-1]
    assert {k: gen[k] for k in FORWARDED} == FORWARDED
    assert gen["logprobs"] is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_default_sampling_forwarded(cluster, path):
    body = chat_body("hi") if "chat" in path else completion_body()
    await cluster.post(path, body)
    gen = cluster.decode.requests[-1]
    assert (gen["temperature"], gen["top_p"], gen["top_k"], gen["min_p"]) == (1.0, 1.0, 0, 0.0)
    assert (gen["presence_penalty"], gen["frequency_penalty"], gen["repetition_penalty"]) == (0.0, 0.0, 1.0)
    assert (gen["logit_bias"], gen["logprobs"], gen["seed"], gen["stop"]) == ({}, None, None, [])


async def test_max_completion_tokens_on_completions(cluster):
    status, _, body = await cluster.post("/v1/completions", completion_body(max_completion_tokens=2))
    assert status == 200, body
    assert cluster.decode.requests[-1]["max_tokens"] == 2 and body["usage"]["completion_tokens"] == 2


def check_chat_item(item: dict, tid: int, k: int) -> None:
    assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
    assert item["token"] == piece(tid) and item["bytes"] == list(piece(tid).encode())
    assert isinstance(item["logprob"], float)
    assert len(item["top_logprobs"]) == k
    for alt in item["top_logprobs"]:
        assert set(alt) == {"token", "logprob", "bytes"} and alt["bytes"] == list(alt["token"].encode())
    if k:
        assert item["top_logprobs"][0]["token"] == item["token"]  # the fake ranks the chosen token first
        assert [a["logprob"] for a in item["top_logprobs"]] == sorted((a["logprob"] for a in item["top_logprobs"]),
                                                                       reverse=True)


@pytest.mark.parametrize("k", [0, 3])
async def test_chat_logprobs(cluster, k):
    status, _, body = await cluster.chat(chat_body("hi", logprobs=True, top_logprobs=k))
    assert status == 200, body
    assert cluster.decode.requests[-1]["logprobs"] == k
    items = body["choices"][0]["logprobs"]["content"]
    assert len(items) == len(REPLY_IDS)
    for item, tid in zip(items, REPLY_IDS):
        check_chat_item(item, tid, k)
    assert "".join(i["token"] for i in items) == body["choices"][0]["message"]["content"] == REPLY


async def test_chat_logprobs_streaming(cluster):
    _, _, events = await cluster.events("/v1/chat/completions", chat_body("hi", logprobs=True, top_logprobs=2))
    chunks = [e for e in events[:-1] if e["choices"] and e["choices"][0]["logprobs"] is not None]
    assert len(chunks) == len(REPLY_IDS)
    for chunk, tid in zip(chunks, REPLY_IDS):
        (item,) = chunk["choices"][0]["logprobs"]["content"]
        check_chat_item(item, tid, 2)
        assert chunk["choices"][0]["delta"]["content"] == item["token"]


async def test_chat_without_logprobs_has_null(cluster):
    _, _, body = await cluster.chat(chat_body("hi", logprobs=False))
    assert body["choices"][0]["logprobs"] is None
    assert cluster.decode.requests[-1]["logprobs"] is None


async def test_completions_logprobs(cluster):
    status, _, body = await cluster.post("/v1/completions", completion_body(max_tokens=32, logprobs=2))
    assert status == 200, body
    assert cluster.decode.requests[-1]["logprobs"] == 2
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == [piece(t) for t in REPLY_IDS] and "".join(lp["tokens"]) == REPLY
    assert all(isinstance(v, float) for v in lp["token_logprobs"])
    assert all(len(d) == 2 and d[tok] == v for d, tok, v in zip(lp["top_logprobs"], lp["tokens"], lp["token_logprobs"]))
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets


async def test_completions_logprobs_streaming(cluster):
    _, _, events = await cluster.events("/v1/completions", completion_body(max_tokens=32, logprobs=1))
    token_chunks = [e["choices"][0] for e in events[:-1] if e["choices"][0]["logprobs"] is not None]
    assert [c["logprobs"]["tokens"][0] for c in token_chunks] == [piece(t) for t in REPLY_IDS]
    assert [c["logprobs"]["text_offset"][0] for c in token_chunks] == [
        len(TOK.tokenizer.decode(REPLY_IDS[:i])) for i in range(len(REPLY_IDS))]


async def test_chat_n_choices(cluster):
    status, _, body = await cluster.chat(chat_body("hi", n=3, seed=7, temperature=1))
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == REPLY for c in body["choices"])
    assert sorted(r["seed"] for r in cluster.decode.requests) == [7, 8, 9]  # different but reproducible
    n = len(TOK.encode_chat([{"role": "user", "content": "hi"}]))
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 21, "total_tokens": n + 21}


async def test_chat_n_choices_streaming(cluster):
    body = chat_body("hi", n=2, stream_options={"include_usage": True})
    _, _, events = await cluster.events("/v1/chat/completions", body)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 14
    chunks = events[:-2]
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert content(events[:-1]) == {0: REPLY, 1: REPLY}
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"][0]["finish_reason"]}
    assert sorted(roles) == [0, 1] and finishes == {0: "stop", 1: "stop"}


async def test_completions_n_choices(cluster):
    status, _, body = await cluster.post("/v1/completions", completion_body(n=2, max_tokens=4, logprobs=0))
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["text"] == cluster.decode.reply_text(4) and len(c["logprobs"]["tokens"]) == 4
               for c in body["choices"])
    _, _, events = await cluster.events("/v1/completions", completion_body(n=2, max_tokens=4))
    texts: dict[int, str] = {}
    for e in events[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: cluster.decode.reply_text(4), 1: cluster.decode.reply_text(4)}


async def test_n_choices_spread_over_decode_nodes(empty_config):
    c = await Cluster(n_decode=2, n_prefill=0).start()
    try:
        for d in c.decoders:
            d.token_delay = 0.02
        status, _, body = await c.chat(chat_body("hi", n=2))
        assert status == 200 and len(body["choices"]) == 2
        assert [len(d.requests) for d in c.decoders] == [1, 1]  # generated concurrently, one per node
    finally:
        await c.stop()


async def test_n_choices_one_fails(cluster):
    cluster.decode.mode = "fail_mid_stream"
    status, _, body = await cluster.chat(chat_body("hi", n=2))
    assert status == 502 and "fake decode failure" in body["error"]["message"]


@pytest.fixture
def tools_model(tmp_path):
    """A model folder whose chat template renders tools (SmolLM2's tokenizer, a tools-aware template)."""
    folder = tmp_path / "tools-model"
    folder.mkdir()
    shutil.copy(MODEL_DIR / "tokenizer.json", folder)
    shutil.copy(MODEL_DIR / "tokenizer_config.json", folder)
    (folder / "chat_template.jinja").write_text(
        "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return folder


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


async def test_tools_rendered_when_template_supports_them(empty_config, tools_model):
    c = await Cluster(n_prefill=0, model_dir=tools_model).start()
    try:
        status, _, body = await c.chat(chat_body("Weather in Paris?", tools=[TOOL], tool_choice="auto"))
        assert status == 200, body
        ids = c.decode.requests[-1]["token_ids"]
        text = ChatTokenizer.from_folder(tools_model).decode(ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\nTools: [") and json.dumps(TOOL) in text
        status, _, body = await c.chat(chat_body("hi", tools=[TOOL], tool_choice="required"))
        assert status == 400 and body["error"]["param"] == "tool_choice"
    finally:
        await c.stop()


def test_token_pieces_are_byte_exact():
    """Byte-level tokens can split a character: bytes concatenate to the text, strings escape partial bytes."""
    from gateway.api.openai.framing import TokenPieces

    pieces = TokenPieces(TOK.tokenizer)
    text = "Emoji 🙂 and 日本語, ça va?"
    ids = TOK.encode(text)
    data = [pieces.piece(t)[1] for t in ids]
    assert bytes(b for chunk in data for b in chunk).decode() == text
    partial = [pieces.piece(t)[0] for t, b in zip(ids, data) if _not_utf8(bytes(b))]
    assert partial and all("\\x" in s and "\ufffd" not in s for s in partial)  # OpenAI-style escapes
    assert pieces.piece(TOK.encode("<|im_end|>")[0]) == ("<|im_end|>", list(b"<|im_end|>"))


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return False
    except UnicodeDecodeError:
        return True
