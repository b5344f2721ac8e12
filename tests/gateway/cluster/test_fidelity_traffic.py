"""A real request whose KV failed the decode node's layer-0 check (done line: fallback_reason kv_fidelity, kv_check)
over fake nodes: the request is answered (its prompt prefilled on the decode node), counted as a fallback, and the
pair is demoted at once with the finding in /health and the WARN line; it stays demoted (issue #50): past the failed
canary's backoff and through short canaries, until a canary of the long form after its hold (which doubles when real
traffic fails it again) or an operator's re-check."""

from __future__ import annotations

import logging

from tests.support.fakes import MODEL_ID, Cluster, chat_body, chat_path, fidelity_row

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


async def _traffic_failure(c: Cluster) -> dict:
    c.decode.mode = "kv_fidelity"
    status, headers, _ = await c.chat(chat_body("x " * 60))
    assert status == 200 and headers["x-disagg-fallbacks"] == "kv_fidelity"
    c.decode.mode = None
    return await fidelity_row(c)


async def test_a_traffic_demotion_outlasts_the_backoff_and_short_canaries_and_an_operator_lifts_it(empty_config,
                                                                                                  caplog):
    """The failed-canary backoff is 0.1 s here and the hold 0.5 s: past both, the canaries that ran (this decode node
    runs no long form, as with start_canary_tokens = 0) verified it and it stays demoted, saying why and until when
    (/health, /metrics); an operator's re-check lifts it."""
    caplog.set_level(logging.WARNING, "gateway.cluster.fidelity")
    c = await Cluster(fidelity={"failed_retry_s": 0.1, "retry_s": 0.1, "traffic_hold_s": 0.5}).start()
    try:
        c.decode.long_canary = False
        row = await _traffic_failure(c)
        assert (row["state"], row["demoted_by"], row["hold"]["count"], row["hold"]["hold_s"]) == \
            ("failed", "traffic", 1, 0.5)
        assert "demoted by real traffic; held until" in row["summary"] and row["hold"]["until"].startswith("20")
        assert await c.metric("disagg_kv_fidelity_demoted", **PAIR, by="traffic") == 1
        assert await c.metric("disagg_kv_fidelity_demoted", **PAIR, by="canary") == 0
        canaries = c.decode.canaries

        async def short_canaries_ran() -> bool:
            return c.decode.canaries >= canaries + 1 and any("not in the long form" in m for m in caplog.messages)
        await c.wait_for(short_canaries_ran)
        row = await fidelity_row(c)
        assert (row["state"], row["usable"], row["demoted_by"]) == ("failed", False, "traffic"), row["summary"]
        assert c.decode.canary_bodies[-1]["long"] is True  # it was asked for the long form
        assert await chat_path(c) == "local"
        status_, _, body = await c.post("/fidelity")  # the operator
        (row,) = body["pairs"]
        assert (row["state"], row["usable"], row["hold"], row["demoted_by"]) == ("verified", True, None, None)
        assert any("lifted by an operator's re-check" in m for m in caplog.messages)
        assert await chat_path(c) == "disaggregated"
    finally:
        await c.stop()


async def test_a_long_canary_repromotes_after_the_hold_and_a_second_failure_doubles_it(empty_config):
    c = await Cluster(fidelity={"traffic_hold_s": 0.3}).start()
    try:
        row = await _traffic_failure(c)
        assert row["hold"]["hold_s"] == 0.3 and await c.metric("disagg_kv_fidelity_hold_seconds", **PAIR) > 0

        async def repromoted() -> bool:
            return (await fidelity_row(c))["state"] == "verified"
        await c.wait_for(repromoted)
        assert c.decode.canary_bodies[-1]["long"] is True and (await fidelity_row(c))["long"]
        assert await chat_path(c) == "disaggregated"
        row = await _traffic_failure(c)
        assert (row["state"], row["hold"]["count"], row["hold"]["hold_s"]) == ("failed", 2, 0.6)
        assert "2 times in a row: its hold doubled" in row["summary"]
    finally:
        await c.stop()
