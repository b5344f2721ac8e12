"""bench_split, bench_long and bench_threshold pointed at a running site by its config (bench/site_target.py): the
target read from a site-local.toml-style config (loopback addresses, its own secrets), and bench_split run against
fake gateway and nodes listening at that config's loopback addresses, checking where each request went and with which
credentials. No engine starts; nothing leaves loopback."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import tomllib

import pytest
from aiohttp import web

from bench import bench_split
from bench.site_target import gateway_config, site
from kv_bridge.config.settings import load_config
from tests.support import ROOT

SITE = ROOT / "examples" / "site-local.toml"
KEY = "sk-bench-site-0123456789abcdef"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.fixture
def config(tmp_path, monkeypatch):
    """site-local.toml with absolute model paths, its own secrets and free ports at its loopback addresses."""
    monkeypatch.delenv("DISAGG_API_KEY", raising=False)
    (tmp_path / "api-keys").write_text(KEY + "\n")
    (tmp_path / "node-secret").write_text("bench-site-secret-0123456789abcdef\n")
    text = SITE.read_text().replace('"../', f'"{ROOT}/')
    text = text.replace(f'"{ROOT}/.disagg/site/api-keys"', '"api-keys"').replace(
        f'"{ROOT}/.disagg/site/node-secret"', '"node-secret"')
    text = re.sub(r"(?m)^port = 8000$", f"port = {_free_port()}", text)
    for host in ("127.0.1.11", "127.0.2.21"):  # spark-0 and mac-0: smollm2's first prefill and decode node
        text = text.replace(f'host = "{host}"\nport = ', f'host = "{host}"\nport = {_free_port(host)}\n#', 1)
    path = tmp_path / "site.toml"
    path.write_text(text)
    return path


def test_the_target_of_a_site_config(config):
    s = load_config(config)
    t = site(config)
    assert t.live and t.model == "smollm2:135m" and t.nodes == {"prefill-0": "spark-0", "decode-0": "mac-0"}
    assert t.url("gateway") == f"http://127.0.0.1:{s.gateway.port}"
    assert t.url("decode-0") == s.node("mac-0").url and t.url("prefill-0") == s.node("spark-0").url
    assert t.headers("gateway") == {"Authorization": f"Bearer {KEY}"}
    assert t.headers("decode-0") == {"Authorization": f"Bearer {s.auth.node_token()}"}
    assert t.min_disagg_tokens == 3 and t.wire == "float8_e4m3" and (t.tokenizer_dir / "tokenizer.json").is_file()
    assert site(config, "gpt-oss:tiny").nodes == {"prefill-0": "spark-1", "decode-0": "mac-0"}
    with pytest.raises(SystemExit, match="not in"):
        site(config, "no-such-model")


def test_a_bench_gateway_config_keeps_the_site_and_sets_the_threshold(config):
    text = gateway_config(config.read_text(), config.parent, 12345, 1_000_000)
    d = tomllib.loads(text)
    assert d["gateway"]["host"] == "127.0.0.1" and d["gateway"]["port"] == 12345
    assert {m["min_disagg_tokens"] for m in d["models"]} == {1_000_000}
    assert d["auth"]["node_secret_file"] == str(config.parent / "node-secret")
    assert [n["name"] for n in d["nodes"]] == [n.name for n in load_config(config).nodes]


def fake_site(settings, seen: list):
    """The gateway (SSE chat, /metrics) and smollm2's first decode and prefill nodes, recording each request."""
    counts = {"disaggregated": 0}

    async def chat(request):
        body = await request.json()
        seen.append(("gateway", request.path, body["model"], request.headers.get("Authorization")))
        counts["disaggregated"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-disagg-path": "disaggregated"})
        await resp.prepare(request)
        for piece in ("Paris", ".", " It"):
            await resp.write(b"data: " + json.dumps({"choices": [{"delta": {"content": piece}}]}).encode() + b"\n\n")
        usage = {"prompt_tokens": 50, "completion_tokens": 3}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    async def metrics(request):
        seen.append(("gateway", request.path, None, request.headers.get("Authorization")))
        return web.Response(text=f'disagg_requests_total{{model="smollm2:135m",path="disaggregated",status="200"}} '
                                 f'{counts["disaggregated"]}\n')

    async def decode(request):
        body = await request.json()
        seen.append(("mac-0", request.path, body["model"], request.headers.get("Authorization")))
        lines = [{"type": "token", "id": 1}, {"type": "token", "id": 2},
                 {"type": "done", "completion_tokens": 2, "prompt_tokens": len(body["token_ids"])}]
        return web.Response(text="".join(json.dumps(x) + "\n" for x in lines), content_type="application/x-ndjson")

    async def prefill(request):
        body = await request.json()
        seen.append(("spark-0", request.path, body["model"], request.headers.get("Authorization")))
        return web.json_response({"token_ids": [1, 2], "text": "x", "finish_reason": "length"})

    gw = web.Application()
    gw.router.add_post("/v1/chat/completions", chat)
    gw.router.add_get("/metrics", metrics)
    mac, spark = web.Application(), web.Application()
    mac.router.add_post("/v1/generate", decode)
    spark.router.add_post("/v1/generate", prefill)
    return [(gw, "127.0.0.1", settings.gateway.port), (mac, "127.0.2.21", settings.node("mac-0").port),
            (spark, "127.0.1.11", settings.node("spark-0").port)]


async def test_bench_split_measures_the_site_its_config_names(config, capsys):
    settings, seen, runners = load_config(config), [], []
    for app, host, port in fake_site(settings, seen):
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
    try:
        await asyncio.to_thread(bench_split.main, ["--config", str(config), "--runs", "1", "--prompt-tokens", "60",
                                                   "--max-tokens", "3"])
    finally:
        for r in runners:
            await r.cleanup()
    out = capsys.readouterr().out
    assert f"measured: the running site of {config}: model smollm2:135m" in out
    assert "mlx_ttft / split_ttft" in out and "gateway paths during the measured runs: {'disaggregated': 1.0}" in out
    token = f"Bearer {settings.auth.node_token()}"
    assert {(w, p, a) for w, p, _, a in seen} == {
        ("gateway", "/v1/chat/completions", f"Bearer {KEY}"), ("gateway", "/metrics", f"Bearer {KEY}"),
        ("mac-0", "/v1/generate", token), ("spark-0", "/v1/generate", token)}
    assert {m for _, _, m, _ in seen if m} == {"smollm2:135m"}
