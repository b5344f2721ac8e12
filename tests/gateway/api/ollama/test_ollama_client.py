"""The official `ollama` Python client against the gateway (fake nodes): its pydantic models must parse our answers.

The client is synchronous (httpx), so calls run in a worker thread while the gateway serves on the test's loop.
"""

from __future__ import annotations

import asyncio

import ollama
import pytest

from tests.support.fakes import MODEL_DIR, MODEL_ID, REPLY
from gateway.text.tokenizer import ChatTokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
N_REPLY = len(ChatTokenizer.from_folder(MODEL_DIR).encode(REPLY))


def client(c) -> "ollama.Client":
    return ollama.Client(host=c.url)


async def call(fn, *args, **kw):
    """Run a client call in a thread; a streaming call's iterator is drained there too."""
    def run():
        out = fn(*args, **kw)
        return list(out) if kw.get("stream") else out
    return await asyncio.to_thread(run)


async def test_list_show_ps(cluster):
    oc = client(cluster)
    listed = await call(oc.list)
    (m,) = listed.models
    assert m.model == MODEL_ID and m.size > 500_000_000 and len(m.digest) == 64
    assert m.modified_at is not None and m.details.family == "llama" and m.details.format == "safetensors"

    shown = await call(oc.show, MODEL_ID)
    assert shown.capabilities == ["completion"] and shown.details == m.details
    assert shown.modelinfo["general.architecture"] == "llama" and "im_start" in shown.template
    assert "num_ctx" in shown.parameters and shown.modified_at is not None

    running = await call(oc.ps)
    (p,) = running.models
    assert p.model == p.name == MODEL_ID and p.size_vram == 0 and p.context_length == 4096
    assert p.expires_at is not None and p.details == m.details


async def test_generate(cluster):
    r = await call(client(cluster).generate, MODEL_ID, "What is the capital of France?", options={"temperature": 0})
    assert r.response == REPLY and r.done and r.done_reason == "stop"
    assert r.eval_count == N_REPLY and r.prompt_eval_count > 0 and r.total_duration > 0
    assert r.context[-N_REPLY:] == ChatTokenizer.from_folder(MODEL_DIR).encode(REPLY)
    assert cluster.decode.requests[-1]["temperature"] == 0


async def test_generate_streaming(cluster):
    parts = await call(client(cluster).generate, MODEL_ID, "hi", stream=True, options={"num_predict": 4})
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(p.response for p in parts) == cluster.decode.reply_text(4)
    assert parts[-1].eval_count == 4


async def test_chat(cluster):
    r = await call(client(cluster).chat, MODEL_ID, messages=QUESTION, options={"temperature": 0, "seed": 1})
    assert r.message.role == "assistant" and r.message.content == REPLY
    assert r.done and r.done_reason == "stop" and r.eval_count == N_REPLY and r.eval_duration >= 0
    sent = cluster.decode.requests[-1]
    assert (sent["temperature"], sent["seed"]) == (0, 1)


async def test_chat_streaming(cluster):
    parts = await call(client(cluster).chat, MODEL_ID, messages=QUESTION, stream=True)
    assert "".join(p.message.content for p in parts) == REPLY
    assert parts[-1].done and parts[-1].done_reason == "stop" and parts[-1].prompt_eval_count > 0
    assert cluster.decode.requests[-1]["temperature"] == 0.8  # Ollama's default


async def test_async_client_chat(cluster):
    r = await ollama.AsyncClient(host=cluster.url).chat(MODEL_ID, messages=QUESTION, options={"temperature": 0})
    assert r.message.content == REPLY


async def test_errors_raise_response_error(cluster):
    oc = client(cluster)
    with pytest.raises(ollama.ResponseError) as e:
        await call(oc.chat, "llama3:8b", messages=QUESTION)
    assert e.value.status_code == 404 and e.value.error == "model 'llama3:8b' not found"
    with pytest.raises(ollama.ResponseError) as e:
        await call(oc.show, "llama3:8b")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        await call(oc.chat, MODEL_ID, messages=QUESTION, think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error


async def test_mid_stream_failure_raises(cluster):
    cluster.decode.mode = "fail_mid_stream"
    with pytest.raises(ollama.ResponseError, match="fake decode failure"):
        await call(client(cluster).chat, MODEL_ID, messages=QUESTION, stream=True)
