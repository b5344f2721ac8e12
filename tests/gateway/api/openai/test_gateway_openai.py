"""The official openai client against the gateway (non-streaming and streaming)."""

from __future__ import annotations

import openai
import pytest

from tests.support.fakes import LONG_TEXT, MODEL_ID, REPLY


def client(c) -> "openai.AsyncOpenAI":
    return openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)

async def test_openai_non_streaming(cluster):
    async with client(cluster) as oc:
        raw = await oc.chat.completions.with_raw_response.create(
            model=MODEL_ID, messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=32, temperature=0
        )
        resp = raw.parse()
    assert resp.choices[0].message.content == REPLY
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 7
    assert raw.headers["x-disagg-path"] == "disaggregated"

async def test_openai_streaming(cluster):
    async with client(cluster) as oc:
        stream = await oc.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    assert "".join(parts) == REPLY
    assert finish == "stop"
    assert usage.completion_tokens == 7

async def test_openai_models_and_errors(cluster):
    async with client(cluster) as oc:
        models = await oc.models.list()
        assert [m.id for m in models.data] == [MODEL_ID]
        with pytest.raises(openai.NotFoundError) as e:
            await oc.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        assert e.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as e:
            await oc.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}],
                                             temperature=3)
        assert e.value.param == "temperature"

async def test_openai_stream_error(cluster):
    cluster.decode.mode = "fail_mid_stream"
    async with client(cluster) as oc:
        stream = await oc.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                                  stream=True)
        with pytest.raises(openai.APIError, match="fake decode failure"):
            async for _ in stream:
                pass
