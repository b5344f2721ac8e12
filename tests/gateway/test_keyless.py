"""Keyless networks in process (fake nodes, the test's loopback peer 127.0.0.1): each API is keyless only when
auth.keyless_apis names it (or "all"), a keyless peer is served whatever key header it sends, and the other APIs still
answer their own 401. The namespace test (test_keyless_netns.py) does the same with real addresses apart."""

from __future__ import annotations

import pytest

from tests.support.fakes import MODEL_ID, Cluster, chat_body

KEY = "sk-keyless-test"
OLLAMA = {"model": MODEL_ID, "prompt": "What is the capital of France?", "stream": False}
ANTHROPIC = {"model": MODEL_ID, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
CALLS = {"ollama": ("/api/generate", OLLAMA), "openai": ("/v1/chat/completions", chat_body()),
         "anthropic": ("/v1/messages", ANTHROPIC), "root": ("/tokenize", {"model": MODEL_ID, "prompt": "hi"})}


async def keyless_cluster(monkeypatch, networks: str, apis: str) -> Cluster:
    monkeypatch.setenv("DISAGG_AUTH__API_KEYS", KEY)
    monkeypatch.setenv("DISAGG_AUTH__KEYLESS_NETWORKS", networks)
    monkeypatch.setenv("DISAGG_AUTH__KEYLESS_APIS", apis)
    return await Cluster().start()


async def status_of(c: Cluster, api: str, headers: dict | None = None) -> tuple[int, dict]:
    path, body = CALLS[api]
    async with c.http.post(c.url + path, json=body, headers=headers or {}) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize("apis,open_", [('["ollama"]', {"ollama"}), ('["anthropic", "openai"]', {"anthropic", "openai"}),
                                        ('["all"]', {"ollama", "openai", "anthropic", "root"})])
async def test_only_the_named_apis_are_keyless(empty_config, monkeypatch, apis, open_):
    c = await keyless_cluster(monkeypatch, '["127.0.0.0/8"]', apis)
    try:
        for api in CALLS:
            status, body = await status_of(c, api)
            if api in open_:
                assert status == 200, (api, body)
            else:  # each API's own refusal
                assert status == 401, (api, body)
                err = body["error"]
                assert (err.startswith("unauthorized: Missing API key") if api == "ollama" else err["type"] in
                        ("invalid_request_error", "authentication_error")), (api, body)
            assert (await status_of(c, api, {"Authorization": f"Bearer {KEY}"}))[0] == 200, api
    finally:
        await c.stop()


async def test_a_keyless_peer_is_served_whatever_key_it_sends(empty_config, monkeypatch):
    """An OpenAI client must send some key: pointed at Ollama it often sends "ollama"."""
    c = await keyless_cluster(monkeypatch, '["127.0.0.1/32"]', '["openai"]')
    try:
        assert (await status_of(c, "openai", {"Authorization": "Bearer ollama"}))[0] == 200
    finally:
        await c.stop()


async def test_a_peer_outside_the_networks_needs_its_key(empty_config, monkeypatch):
    c = await keyless_cluster(monkeypatch, '["10.0.0.0/8"]', '["all"]')
    try:
        status, body = await status_of(c, "ollama")
        assert status == 401 and body["error"].startswith("unauthorized: Missing API key"), body
        status, body = await status_of(c, "openai", {"Authorization": "Bearer ollama"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    finally:
        await c.stop()
