"""Model aliases (config.toml `aliases`): every alias is served on both APIs (the node is asked for the model's id),
listed by /v1/models and /api/tags, and unique across models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.support.fakes import MODEL_ID, Cluster, FakeDecodeNode, chat_body, make_settings

ALIASES = ["openai/gpt-oss-120b", "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8"]


@pytest.fixture
async def aliased(empty_config):
    c = await Cluster(route={"aliases": ALIASES}).start()
    yield c
    await c.stop()


async def test_aliases_are_listed_on_both_apis(aliased):
    async with aliased.http.get(f"{aliased.url}/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL_ID, *ALIASES]
    async with aliased.http.get(f"{aliased.url}/v1/models/{ALIASES[0]}") as r:
        assert r.status == 200 and (await r.json())["id"] == ALIASES[0]
    async with aliased.http.get(f"{aliased.url}/api/tags") as r:
        models = (await r.json())["models"]
    assert [m["name"] for m in models] == [m["model"] for m in models] == [MODEL_ID, *ALIASES]
    assert len({m["digest"] for m in models}) == 1  # one model under three names


@pytest.mark.parametrize("alias", ALIASES)
async def test_every_alias_serves_on_both_apis(aliased, alias):
    status, _, body = await aliased.chat(chat_body(model=alias, max_tokens=8))
    assert status == 200 and body["model"] == alias, body
    assert aliased.decode.requests[-1]["model"] == MODEL_ID
    status, _, body = await aliased.post("/api/chat", {"model": alias, "stream": False,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["model"] == alias, body
    status, _, body = await aliased.post("/api/generate", {"model": alias, "prompt": "hi", "stream": False})
    assert status == 200 and body["model"] == alias, body
    assert aliased.decode.requests[-1]["model"] == MODEL_ID


def test_aliases_must_be_unique_across_models(empty_config):
    d = [FakeDecodeNode("decode-0")]
    d[0].port = d[0].kv_port = 9  # never started: the settings only need valid ports
    s = make_settings(d, [], route={"aliases": ["a", "b"]})
    assert s.route("b").id == MODEL_ID and s.route("nope") is None
    with pytest.raises(ValidationError, match="unique"):
        make_settings(d, [], route={"aliases": [MODEL_ID]})
    with pytest.raises(ValidationError, match="unique"):
        make_settings(d, [], route={"aliases": ["a", "a"]})
