"""Authentication: client API keys on the gateway (fake nodes), the node credential on real node apps, and the
[auth] configuration (env, files, exposure rules)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web

from backends.common import node_app, node_token
from tests.support.fakes import MODEL_DIR, MODEL_ID, REPLY, Cluster, chat_body, free_port
from kv_bridge.config.auth import AuthConfig
from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings, load_config
from kv_bridge.config.source import ConfigError

KEYS = ("sk-test-one", "sk-test-two")
SECRET = "node-secret-for-tests-0123456789"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def auth_env(empty_config, monkeypatch):
    """Set DISAGG_AUTH__* for the cluster built next (the fake cluster's Settings leave [auth] to the env)."""
    def set_env(**values: str) -> None:
        for k, v in values.items():
            monkeypatch.setenv(f"DISAGG_AUTH__{k.upper()}", v)
    set_env(api_keys=",".join(KEYS))
    return set_env


@pytest.fixture
async def keyed(auth_env):
    c = await Cluster().start()
    yield c
    await c.stop()


async def get(c: Cluster, path: str, key: str | None = None, auth: str | None = None) -> tuple[int, dict, object]:
    headers = {"Authorization": auth or f"Bearer {key}"} if (key or auth) else {}
    async with c.http.get(c.url + path, headers=headers) as r:
        body = await r.json(content_type=None) if "json" in r.content_type else await r.text()
        return r.status, dict(r.headers), body


async def post(c: Cluster, path: str, body: dict, key: str | None = None) -> tuple[int, dict, object]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with c.http.post(c.url + path, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


# ---- gateway: client API keys ----

@pytest.mark.parametrize("path,method", [("/v1/chat/completions", "post"), ("/v1/completions", "post"),
                                         ("/v1/models", "get"), ("/v1/models/" + MODEL_ID, "get"),
                                         ("/v1/no-such-route", "get")])
async def test_openai_routes_refuse_a_missing_or_wrong_key(keyed, path, method):
    call = (lambda **kw: post(keyed, path, chat_body(), **kw)) if method == "post" else (
        lambda **kw: get(keyed, path, **kw))
    status, headers, body = await call()
    assert status == 401
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in body["error"]["message"] and body["error"]["param"] is None
    assert headers["WWW-Authenticate"] == 'Bearer realm="disagg"'

    status, headers, body = await call(key="sk-not-a-key")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert "sk-not-a-key" not in body["error"]["message"]  # a wrong key is never echoed back
    assert headers["WWW-Authenticate"] == 'Bearer realm="disagg", error="invalid_token"'
    assert keyed.decode.requests == []  # nothing reached a node


async def test_other_schemes_and_empty_bearer_are_refused(keyed):
    for auth in (f"Basic {KEYS[0]}", "Bearer", "Bearer   ", KEYS[0], f"Bearer {KEYS[0]}x"):
        status, _, body = await get(keyed, "/v1/models", auth=auth)
        assert status == 401, auth


@pytest.mark.parametrize("path,method", [("/api/chat", "post"), ("/api/generate", "post"), ("/api/tags", "get"),
                                         ("/api/version", "get"), ("/api/show", "post")])
async def test_ollama_routes_answer_401_in_ollama_shape(keyed, path, method):
    body = {"model": MODEL_ID, "messages": QUESTION, "prompt": "hi"}
    for key in (None, "wrong"):
        if method == "post":
            status, headers, got = await post(keyed, path, body, key=key)
        else:
            status, headers, got = await get(keyed, path, key=key)
        assert status == 401
        assert list(got) == ["error"] and isinstance(got["error"], str) and "unauthorized" in got["error"]
        assert headers["WWW-Authenticate"].startswith('Bearer realm="disagg"')


@pytest.mark.parametrize("path,ollama_shape", [("/nope", False), ("/v1", False), ("/v1/models/a/b", False),
                                               ("/api", True), ("/api/pull", True)])
async def test_unknown_routes_answer_401_before_404_in_their_apis_shape(keyed, path, ollama_shape):
    status, headers, body = await get(keyed, path)
    assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="disagg"'
    if ollama_shape:
        assert list(body) == ["error"] and body["error"].startswith("unauthorized: Missing API key")
    else:
        assert body["error"]["code"] == "invalid_api_key"
    status, _, body = await get(keyed, path, key=KEYS[0])
    assert status == 404 and isinstance(body["error"], str) == ollama_shape


async def test_an_open_route_with_another_method_needs_a_key(keyed):
    """Open is a route's handler, not its path: POST /health is refused before it is found not allowed."""
    assert (await post(keyed, "/health", {}))[0] == 401
    status, headers, body = await post(keyed, "/health", {}, key=KEYS[0])
    assert status == 405 and body["error"]["code"] == "method_not_allowed" and "GET" in headers["Allow"]


async def test_every_configured_key_works(keyed):
    for key in KEYS:
        status, _, body = await post(keyed, "/v1/chat/completions", chat_body(temperature=0), key=key)
        assert status == 200 and body["choices"][0]["message"]["content"] == REPLY
        status, _, body = await get(keyed, "/api/tags", key=key)
        assert status == 200 and body["models"][0]["name"] == MODEL_ID


async def test_openai_client_with_a_valid_key(keyed):
    import openai
    client = openai.AsyncOpenAI(base_url=keyed.url + "/v1", api_key=KEYS[1], max_retries=0)
    try:
        r = await client.chat.completions.create(model=MODEL_ID, messages=QUESTION, temperature=0)
        assert r.choices[0].message.content == REPLY
        stream = await client.chat.completions.create(model=MODEL_ID, messages=QUESTION, temperature=0, stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == REPLY
        assert [m.id async for m in client.models.list()] == [MODEL_ID]
    finally:
        await client.close()
    bad = openai.AsyncOpenAI(base_url=keyed.url + "/v1", api_key="sk-wrong", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            await bad.chat.completions.create(model=MODEL_ID, messages=QUESTION)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    finally:
        await bad.close()


async def test_ollama_client_with_a_valid_key(keyed):
    import ollama
    good = ollama.Client(host=keyed.url, headers={"Authorization": f"Bearer {KEYS[0]}"})
    r = await asyncio.to_thread(good.chat, MODEL_ID, messages=QUESTION, options={"temperature": 0})
    assert r.message.content == REPLY
    chunks = await asyncio.to_thread(lambda: list(good.generate(MODEL_ID, prompt="Capital of France?", stream=True)))
    assert chunks[-1].done and "".join(c.response for c in chunks) == REPLY
    assert (await asyncio.to_thread(good.list)).models[0].model == MODEL_ID

    with pytest.raises(ollama.ResponseError) as e:
        await asyncio.to_thread(ollama.Client(host=keyed.url).chat, MODEL_ID, messages=QUESTION)
    assert e.value.status_code == 401 and "unauthorized" in e.value.error


async def test_health_root_and_metrics_are_open_by_default(keyed):
    status, _, body = await get(keyed, "/health")
    assert status == 200 and body["status"] == "ok"
    status, _, text = await get(keyed, "/metrics")
    assert status == 200 and "disagg_node_up" in text
    status, _, text = await get(keyed, "/")
    assert status == 200 and text == "Ollama is running"


@pytest.mark.parametrize("protect", ["health", "metrics"])
async def test_health_and_metrics_can_require_a_key(auth_env, protect):
    auth_env(**{f"protect_{protect}": "true"})
    c = await Cluster().start()
    try:
        locked = ["/health", "/"] if protect == "health" else ["/metrics"]
        still_open = ["/metrics"] if protect == "health" else ["/health", "/"]
        for path in locked:
            assert (await get(c, path))[0] == 401, path
            assert (await get(c, path, key=KEYS[0]))[0] == 200, path
        for path in still_open:
            assert (await get(c, path))[0] == 200, path
    finally:
        await c.stop()


async def test_without_keys_the_gateway_stays_open(cluster):
    assert (await cluster.chat(chat_body()))[0] == 200
    async with cluster.http.get(cluster.url + "/api/tags") as r:
        assert r.status == 200
    # a client that sends a key anyway (the openai client always does) is served too
    async with cluster.http.get(cluster.url + "/v1/models", headers={"Authorization": "Bearer anything"}) as r:
        assert r.status == 200


async def test_keys_from_a_file_and_from_a_json_env_list(auth_env, tmp_path):
    keyfile = tmp_path / "keys.txt"
    keyfile.write_text("# one key a line\nsk-from-file\n\n  sk-indented  \n")
    auth_env(api_keys='["sk-json-a", "sk-json-b"]', api_keys_file=str(keyfile))
    c = await Cluster().start()
    try:
        for key in ("sk-json-a", "sk-json-b", "sk-from-file", "sk-indented"):
            assert (await get(c, "/v1/models", key=key))[0] == 200, key
        assert (await get(c, "/v1/models", key=KEYS[0]))[0] == 401  # replaced by the JSON list
        assert (await get(c, "/v1/models", key="#"))[0] == 401
    finally:
        await c.stop()


# ---- nodes: the gateway's node credential ----

async def _noop(app: web.Application) -> None:
    return None


async def _serve_node(token: str | None, role: str = "decode") -> tuple[web.AppRunner, int]:
    app = node_app(lambda: {"role": role, "models": [MODEL_ID]}, _noop, _noop, token=token)

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"got": await request.json()})

    app.router.add_post("/v1/echo", echo)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def test_node_refuses_calls_without_the_node_credential():
    token = AuthConfig(node_secret=SECRET).node_token()
    runner, port = await _serve_node(token)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {SECRET}"},
                            {"Authorization": f"Basic {token}"}):
                for method, path in (("GET", "/health"), ("POST", "/v1/echo"), ("GET", "/nowhere")):
                    async with http.request(method, url + path, json={"a": 1}, headers=headers) as r:
                        body = await r.json()
                        assert r.status == 401, (headers, path)
                        assert body["error"]["code"] == "unauthorized" and "node_secret" in body["error"]["message"]
                        assert r.headers["WWW-Authenticate"] == 'Bearer realm="disagg-node"'
            ok = {"Authorization": f"Bearer {token}"}
            async with http.get(url + "/health", headers=ok) as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            async with http.post(url + "/v1/echo", json={"a": 1}, headers=ok) as r:
                assert r.status == 200 and await r.json() == {"got": {"a": 1}}
    finally:
        await runner.cleanup()


async def test_node_without_a_secret_stays_open():
    runner, port = await _serve_node(None)
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/health") as r:
            assert r.status == 200
    finally:
        await runner.cleanup()


def _gateway_settings(node_port: int, secret: str | None) -> Settings:
    return Settings(
        gateway={"port": free_port(), "health_interval_s": 0.2}, prefill={}, decode={}, kv={},
        auth={} if secret is None else {"node_secret": secret},
        nodes=[{"name": "decode-0", "role": "decode", "port": node_port, "kv_port": free_port()}],
        models=[{"id": MODEL_ID, "path": str(MODEL_DIR), "decode": ["decode-0"]}],
    )


@pytest.mark.parametrize("gateway_secret,up", [(SECRET, True), (None, False), ("another-secret-0123456789", False)])
async def test_gateway_sends_the_node_credential(empty_config, gateway_secret, up):
    """A real node app with a secret: the gateway's health checks reach it only with the same secret."""
    from gateway.app import create_app

    node_runner, node_port = await _serve_node(AuthConfig(node_secret=SECRET).node_token())
    gw = web.AppRunner(create_app(_gateway_settings(node_port, gateway_secret)), shutdown_timeout=0.1)
    await gw.setup()
    try:
        await web.TCPSite(gw, "127.0.0.1", 0).start()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{gw.addresses[0][1]}/health") as r:
                body = await r.json()
        (node,) = body["nodes"]
        assert node["up"] is up and r.status == (200 if up else 503)
        if not up:
            assert "401" in node["reason"]
    finally:
        await gw.cleanup()
        await node_runner.cleanup()


# ---- configuration ----

def test_node_token_and_kv_key_are_derived_apart():
    a = AuthConfig(node_secret=SECRET)
    token, key = a.node_token(), a.kv_key()
    assert len(token) == 64 and len(key) == 32
    assert SECRET not in token and token != key.hex()  # the HTTP token (sent in clear) does not give the KV key
    assert AuthConfig(node_secret=SECRET + "x").node_token() != token
    assert AuthConfig().node_token() is None and AuthConfig().kv_key() is None
    assert SECRET not in repr(a) and KEYS[0] not in repr(AuthConfig(api_keys=list(KEYS)))


def test_secret_from_a_file(tmp_path):
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    assert AuthConfig(node_secret_file=f).node_token() == AuthConfig(node_secret=SECRET).node_token()
    with pytest.raises(ConfigError, match="cannot read"):
        AuthConfig(node_secret_file=tmp_path / "missing").node_token()
    f.write_text("short")
    with pytest.raises(ConfigError, match="shorter than 16"):
        AuthConfig(node_secret_file=f).kv_key()
    with pytest.raises(ConfigError, match="cannot read"):
        AuthConfig(api_keys_file=tmp_path / "missing").client_keys()


def test_config_errors_name_the_fix(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("DISAGG_")]:
        monkeypatch.delenv(k)
    cfg = tmp_path / "config.toml"
    monkeypatch.setenv("DISAGG_CONFIG", str(cfg))  # load_config() reads it; monkeypatch restores it after
    cases = {
        '[auth]\nnode_secret = "short"\n': "secrets.token_urlsafe",
        f'[auth]\nnode_secret = "{SECRET}"\nnode_secret_file = "x"\n': "not both",
        '[auth]\napi_keys = ["has space"]\n': "without spaces",
    }
    for text, fix in cases.items():
        cfg.write_text(text)
        with pytest.raises(ConfigError, match=fix):
            load_config()
    monkeypatch.setenv("DISAGG_AUTH__NODE_SECRET", SECRET)
    monkeypatch.setenv("DISAGG_AUTH__API_KEYS", "k1")
    cfg.write_text("")
    s = load_config()
    assert s.auth.node_token() == AuthConfig(node_secret=SECRET).node_token() and s.auth.client_keys() == ["k1"]


def _settings(host: str, **auth) -> tuple[Settings, NodeConfig]:
    s = Settings(gateway={}, prefill={}, decode={}, kv={}, auth=auth, models=[],
                 nodes=[{"name": "decode-0", "role": "decode", "host": host, "port": 8200, "kv_port": 8201}])
    return s, s.nodes[0]


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "mac-studio.local", "::"])
def test_a_node_reachable_from_other_hosts_needs_a_secret(empty_config, host, caplog):
    s, node = _settings(host)
    with pytest.raises(ConfigError, match="node_secret") as e:
        node_token(s, node)
    assert "insecure_nodes" in str(e.value) and "8201" in str(e.value)
    s, node = _settings(host, node_secret=SECRET)
    assert node_token(s, node) == AuthConfig(node_secret=SECRET).node_token()
    s, node = _settings(host, insecure_nodes=True)
    with caplog.at_level(logging.WARNING):
        assert node_token(s, node) is None
    assert "INSECURE" in caplog.text


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_nodes_may_run_open(empty_config, host):
    s, node = _settings(host)
    assert node_token(s, node) is None


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_exposed_node_without_a_secret_exits_with_the_fix(tmp_path, role):
    exposed = {"prefill": "127.0.0.1", "decode": "127.0.0.1", role: "0.0.0.0"}
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"""
[[nodes]]
name = "p"
role = "prefill"
host = "{exposed['prefill']}"
port = {free_port()}

[[nodes]]
name = "d"
role = "decode"
host = "{exposed['decode']}"
port = {free_port()}
kv_port = {free_port()}

[[models]]
id = "{MODEL_ID}"
path = "{MODEL_DIR}"
prefill = ["p"]
decode = ["d"]
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    r = subprocess.run([sys.executable, "-m", "backends.cli.main", role, "--node", role[0], "--config", str(cfg)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "no node secret is set" in r.stderr and "insecure_nodes" in r.stderr


def test_disagg_up_checks_health_with_the_credentials(empty_config):
    from backends.cli.up import plan

    s = Settings(gateway={}, prefill={}, decode={}, kv={}, models=[],
                 auth={"node_secret": SECRET, "api_keys": list(KEYS), "protect_health": True},
                 nodes=[{"name": "decode-0", "role": "decode", "port": 8200, "kv_port": 8201}])
    node, gw = plan(s)
    assert node.headers == {"Authorization": f"Bearer {AuthConfig(node_secret=SECRET).node_token()}"}
    assert gw.headers == {"Authorization": f"Bearer {KEYS[0]}"}
    s = Settings(gateway={}, prefill={}, decode={}, kv={}, models=[], auth={},
                 nodes=[{"name": "decode-0", "role": "decode", "port": 8200, "kv_port": 8201}])
    assert [c.headers for c in plan(s)] == [{}, {}]
