"""The upstream path keeps a reasoning model's reasoning: an OpenAI-compatible upstream (vLLM serving gpt-oss) streams
`reasoning` / `reasoning_content` deltas apart from `content`, and the gateway answers with them split as the
cluster path does (OpenAI `reasoning_content`, Ollama `thinking`), read by the `openai` and `ollama` clients."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from tests.support.fakes import MODEL_ID, Cluster, FakeUpstream
from tests.support.tiny_models import write_family_tokenizer

REASONING = "The user wants the capital. It is Paris."
ANSWER = "Paris."


class ReasoningUpstream(FakeUpstream):
    """Streams reasoning deltas under `field` (vLLM sends `reasoning`, older servers `reasoning_content`), then the
    answer, as vLLM's chat completion stream does."""

    def __init__(self, field: str) -> None:
        super().__init__(ANSWER)
        self.field = field

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {"id": "up-1", "created": 1, "model": body.get("model"), "object": "chat.completion.chunk"}
        deltas = [{"role": "assistant", "content": ""}]
        deltas += [{self.field: w + " "} for w in REASONING.split(" ")]
        deltas += [{"content": ANSWER}]
        for d in deltas:
            ev = {**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        ev = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await resp.write(f"data: {json.dumps(ev)}\n\ndata: [DONE]\n\n".encode())
        return resp


@pytest.fixture(params=[("gpt_oss", "reasoning"), ("gpt_oss", "reasoning_content"), ("think", "reasoning")])
async def upstream(request, tmp_path, empty_config):
    """gpt-oss (harmony) or a `<think>` model whose decode node is down: every request goes upstream."""
    kind, field = request.param
    if kind == "gpt_oss":
        folder = write_family_tokenizer(tmp_path / "gpt_oss", "gpt_oss")
        (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
        c = Cluster(n_prefill=0, upstream=True, model_dir=folder)
    else:
        c = Cluster(n_prefill=0, upstream=True, route={"reasoning_parser": "think"})
    c.upstream = ReasoningUpstream(field)
    await c.start()
    c.decode.down = True
    yield c
    await c.stop()


async def test_openai_answer_keeps_upstream_reasoning(upstream):
    import openai
    client = openai.AsyncOpenAI(base_url=upstream.url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Capital of France?"}]
    try:
        r = await client.with_raw_response.chat.completions.create(model=MODEL_ID, messages=msgs)
        assert r.headers["x-disagg-path"] == "upstream"
        msg = r.parse().choices[0].message
        assert (msg.reasoning_content.strip(), msg.content) == (REASONING, ANSWER)
        reasoning, content = "", ""
        async for ev in await client.chat.completions.create(model=MODEL_ID, messages=msgs, stream=True):
            for ch in ev.choices:
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                content += ch.delta.content or ""
        assert (reasoning.strip(), content) == (REASONING, ANSWER)
    finally:
        await client.close()


async def test_ollama_answer_keeps_upstream_thinking(upstream):
    import ollama
    r = await ollama.AsyncClient(host=upstream.url).chat(MODEL_ID, messages=[{"role": "user", "content": "hi"}])
    assert (r.message.thinking.strip(), r.message.content) == (REASONING, ANSWER)
    sent = upstream.upstream.requests[-1]["messages"]
    assert sent == [{"role": "user", "content": "hi"}]  # the client's messages, not the template's
