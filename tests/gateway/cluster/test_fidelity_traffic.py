"""A real request whose KV failed the decode node's layer-0 check (done line: fallback_reason kv_fidelity, kv_check)
over fake nodes: the request is answered (its prompt prefilled on the decode node), counted as a fallback, and the
pair is demoted at once, as a failed canary would leave it, with the finding in /health and the WARN line."""

from __future__ import annotations

import logging

from tests.support.fakes import MODEL_ID, chat_body

PAIR = {"model": MODEL_ID, "prefill": "prefill-0", "decode": "decode-0"}


async def test_a_request_whose_kv_failed_the_check_falls_back_and_demotes_the_pair(cluster, caplog):
    caplog.set_level(logging.INFO, "gateway.cluster.fidelity")
    (row,) = await cluster.wait_fidelity()
    assert row["state"] == "verified" and row["usable"]
    cluster.decode.mode = "kv_fidelity"
    status, headers, body = await cluster.chat(chat_body("x " * 60))
    assert status == 200, body
    assert headers["x-disagg-path"] == "fallback" and headers["x-disagg-fallbacks"] == "kv_fidelity"
    assert await cluster.metric("disagg_fallbacks_total", model=MODEL_ID, reason="kv_fidelity") == 1
    async with cluster.http.get(cluster.url + "/health") as r:
        (row,) = (await r.json())["fidelity"]
    assert (row["state"], row["usable"], row["metric"]) == ("failed", False, "real-traffic position error")
    assert "layer-0 check" in row["summary"] and "K layer 0 position 40" in row["summary"]
    assert await cluster.metric("disagg_kv_fidelity", **PAIR) == 0
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("FAILED" in w and "K layer 0 position 40" in w and "prefill on decode-0" in w for w in warn), warn
    cluster.decode.mode = None
    status, headers, _ = await cluster.chat(chat_body("x " * 60))
    assert status == 200 and headers["x-disagg-path"] == "local"  # demoted: no KV until the canary verifies again
