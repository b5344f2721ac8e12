"""/metrics deltas: one requests_total increment per request with the right labels; token counters by exact counts."""

from __future__ import annotations

from tests.support.fakes import LONG_TEXT, MODEL_ID, chat_body

TOTAL = "disagg_requests_total"

async def test_metric_names_present(cluster):
    await cluster.chat(chat_body("hi"))
    async with cluster.http.get(f"{cluster.url}/metrics") as r:
        text = await r.text()
        assert r.headers["Content-Type"].startswith("text/plain")
    for name in (
        "disagg_requests_total", "disagg_time_to_first_token_seconds_bucket", "disagg_inter_token_latency_seconds_bucket",
        "disagg_e2e_request_latency_seconds_bucket", "disagg_prefill_seconds", "disagg_kv_transfer_seconds",
        "disagg_kv_transfer_bytes_total", "disagg_prompt_tokens_total", "disagg_generation_tokens_total",
        "disagg_requests_running", "disagg_node_up",
    ):
        assert name in text, name
    assert 'disagg_node_up{node="decode-0",role="decode"} 1.0' in text
    assert "req-" not in text  # no request ids in labels

async def test_request_counters(cluster):
    m = cluster.metric
    labels = {"model": MODEL_ID}
    before = {
        "dis": await m(TOTAL, model=MODEL_ID, path="disaggregated", status="ok"),
        "loc": await m(TOTAL, model=MODEL_ID, path="local", status="ok"),
        "prompt": await m("disagg_prompt_tokens_total", **labels),
        "gen": await m("disagg_generation_tokens_total", **labels),
        "kv": await m("disagg_kv_transfer_bytes_total", **labels),
        "prefill": await m("disagg_prefill_seconds_count", **labels),
        "ttft": await m("disagg_time_to_first_token_seconds_count", **labels),
        "itl": await m("disagg_inter_token_latency_seconds_count", **labels),
    }
    _, _, a = await cluster.chat(chat_body(LONG_TEXT, max_tokens=4))
    assert await m(TOTAL, model=MODEL_ID, path="disaggregated", status="ok") == before["dis"] + 1
    assert await m(TOTAL, model=MODEL_ID, path="local", status="ok") == before["loc"]
    _, _, b = await cluster.chat(chat_body("hi", stream=False))
    assert await m(TOTAL, model=MODEL_ID, path="local", status="ok") == before["loc"] + 1
    assert await m(TOTAL, model=MODEL_ID, path="disaggregated", status="ok") == before["dis"] + 1

    ua, ub = a["usage"], b["usage"]
    assert await m("disagg_prompt_tokens_total", **labels) == before["prompt"] + ua["prompt_tokens"] + ub["prompt_tokens"]
    assert await m("disagg_generation_tokens_total", **labels) == (
        before["gen"] + ua["completion_tokens"] + ub["completion_tokens"]
    )
    # The fake reports 1000 bytes per KV token; only the disaggregated request moved KV.
    assert await m("disagg_kv_transfer_bytes_total", **labels) == before["kv"] + 1000 * (ua["prompt_tokens"] - 1)
    assert await m("disagg_prefill_seconds_count", **labels) == before["prefill"] + 1
    assert await m("disagg_time_to_first_token_seconds_count", **labels) == before["ttft"] + 2
    steps = ua["completion_tokens"] - 1 + ub["completion_tokens"] - 1
    assert await m("disagg_inter_token_latency_seconds_count", **labels) == before["itl"] + steps
    assert await m("disagg_requests_running", **labels) == 0

async def test_streaming_counted_once(cluster):
    key = {"model": MODEL_ID, "path": "local", "status": "ok"}
    before = await cluster.metric(TOTAL, **key)
    async with cluster.http.post(f"{cluster.url}/v1/chat/completions", json=chat_body("hi", stream=True)) as r:
        await r.read()
    assert await cluster.metric(TOTAL, **key) == before + 1

async def test_error_labels(cluster):
    m = cluster.metric
    bad = await m(TOTAL, model="unknown", path="none", status="4xx")
    await cluster.chat({**chat_body(), "model": "nope"})
    await cluster.chat(raw=b"{")
    assert await m(TOTAL, model="unknown", path="none", status="4xx") == bad + 2

    ctx = await m(TOTAL, model=MODEL_ID, path="none", status="4xx")
    await cluster.chat(chat_body("hi", max_tokens=10**6))
    assert await m(TOTAL, model=MODEL_ID, path="none", status="4xx") == ctx + 1

    cluster.decode.mode = "fail_mid_stream"
    err = await m(TOTAL, model=MODEL_ID, path="local", status="error")
    async with cluster.http.post(f"{cluster.url}/v1/chat/completions", json=chat_body("hi", stream=True)) as r:
        await r.read()
    assert await m(TOTAL, model=MODEL_ID, path="local", status="error") == err + 1
    five = await m(TOTAL, model=MODEL_ID, path="local", status="5xx")
    await cluster.chat(chat_body("hi"))
    assert await m(TOTAL, model=MODEL_ID, path="local", status="5xx") == five + 1
    assert await m("disagg_requests_running", model=MODEL_ID) == 0

async def test_fallback_label(cluster):
    cluster.decode.mode = "kv_error"
    key = {"model": MODEL_ID, "path": "fallback", "status": "ok"}
    before = await cluster.metric(TOTAL, **key)
    await cluster.chat(chat_body(LONG_TEXT))
    assert await cluster.metric(TOTAL, **key) == before + 1

async def test_node_up_gauge(cluster):
    assert await cluster.metric("disagg_node_up", node="prefill-0", role="prefill") == 1
    cluster.prefill.down = True

    async def is_down() -> bool:
        return await cluster.metric("disagg_node_up", node="prefill-0", role="prefill") == 0

    await cluster.wait_for(is_down)
