"""The KV fidelity verdict's lifecycle in the gateway over fake nodes: only a completed comparison moves it (a busy
node's 429, on demand included, leaves a verified pair verified and marks it stale); it stands for the nodes it was
measured on (a restart or a changed KV configuration re-verifies before traffic); failed pairs are retried with
backoff, verified ones re-checked; errors have their own gauge value and alert; overrides carry their reason."""

from __future__ import annotations

import asyncio
import logging

import pytest
from pydantic import ValidationError

from gateway.cluster.fidelity import _backoff
from kv_bridge.fidelity import FidelityConfig
from tests.support.fakes import (MODEL_ID, Cluster, FakeDecodeNode, FakePrefillNode, chat_body, chat_path, fidelity_row,
                                 make_settings)

PAIR = {"model": MODEL_ID, "prefill": "prefill-0", "decode": "decode-0"}


async def _seen(c: Cluster, up: bool) -> None:
    async def seen() -> bool:
        async with c.http.get(c.url + "/health") as r:
            return {n["name"]: n["up"] for n in (await r.json())["nodes"]}["decode-0"] == up
    await c.wait_for(seen)


def _messages(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == "gateway.cluster.fidelity"]


async def test_a_busy_decode_node_never_demotes_a_verified_pair(cluster, caplog):
    """429 kv_capacity on the canary, asked for on demand (as `disagg status` does): the verdict stands, stale."""
    caplog.set_level(logging.INFO, "gateway.cluster.fidelity")
    (row,) = await cluster.wait_fidelity()
    assert row["state"] == "verified" and not row["stale"] and row["age_s"] is not None
    cluster.decode.mode = "kv_capacity"
    status, _, body = await cluster.post("/fidelity")
    assert status == 200
    (row,) = body["pairs"]
    assert (row["state"], row["usable"], row["stale"], row["errors"]) == ("verified", True, True, 1)
    assert "429" in row["last_error"] and "stale" in row["summary"] and row["error"] == 1e-5
    assert await cluster.metric("disagg_kv_fidelity", **PAIR) == 1
    assert await cluster.metric("disagg_kv_fidelity_errors", **PAIR) == 1
    assert await cluster.metric("disagg_kv_fidelity_usable", **PAIR) == 1
    (warn,) = _messages(caplog, logging.WARNING)
    assert "could not be checked (1 in a row)" in warn and "429" in warn and "keeps its verdict (verified" in warn
    cluster.decode.mode = None
    assert await chat_path(cluster) == "disaggregated"  # the busy moment passed: the pair never left the split
    status, _, body = await cluster.post("/fidelity")
    (row,) = body["pairs"]
    assert (row["state"], row["stale"], row["errors"], row["last_error"]) == ("verified", False, 0, None)


async def test_a_node_back_as_the_same_process_keeps_its_verdict_one_without_a_boot_id_does_not(cluster):
    await cluster.wait_fidelity()
    cluster.decode.down = True  # e.g. health checks unanswered on a loaded Mac
    await _seen(cluster, False)
    row = await fidelity_row(cluster)
    assert row["state"] == "verified" and row["stale"] and "a node is down" in row["summary"]
    cluster.decode.down = False
    await _seen(cluster, True)
    assert await chat_path(cluster) == "disaggregated" and cluster.decode.canaries == 1

    cluster.decode.boot_id = None  # a node that cannot say who it is: each time it comes up, it is checked again
    cluster.decode.down = True
    await _seen(cluster, False)
    cluster.decode.down = False

    async def checked_again() -> bool:
        return cluster.decode.canaries == 2
    await cluster.wait_for(checked_again)


async def test_a_changed_kv_configuration_is_verified_again_before_it_carries_kv(cluster, caplog):
    caplog.set_level(logging.WARNING, "gateway.cluster.fidelity")
    await cluster.wait_fidelity()
    cluster.decode.canary_hold = hold = asyncio.Event()
    cluster.decode.kv_digest, cluster.decode.kv_dtype = "kv1", "bfloat16"  # reconfigured, same boot id (a test)

    async def noticed() -> bool:  # and its canary started
        return (await fidelity_row(cluster))["state"] == "checking"
    await cluster.wait_for(noticed)
    row = await fidelity_row(cluster)
    assert not row["usable"] and "decode-0's KV configuration changed (dtype float32 -> bfloat16)" in row["reverify"]
    assert await cluster.metric("disagg_kv_fidelity", **PAIR) == -1
    assert await chat_path(cluster) == "local"
    assert any("KV configuration changed (dtype float32 -> bfloat16)" in m and "checked again before it carries KV" in m
               for m in _messages(caplog, logging.WARNING))
    hold.set()
    (row,) = await cluster.wait_fidelity()
    assert row["state"] == "verified" and row["usable"] and cluster.decode.canaries == 2
    assert await chat_path(cluster) == "disaggregated"

    cluster.decode.boot_id, cluster.decode.kv_dtype = "b2" * 16, "float16"  # restarted with another KV dtype

    async def said() -> bool:
        return any("decode-0 restarted (boot id " in m and "-> b2b2b2b2; its KV configuration changed: dtype "
                   "bfloat16 -> float16)" in m for m in _messages(caplog, logging.WARNING))
    await cluster.wait_for(said)


def test_the_backoff_doubles_up_to_its_cap():
    assert [_backoff(30, n, 900) for n in range(1, 8)] == [30, 60, 120, 240, 480, 900, 900]
    cfg = FidelityConfig()
    assert (cfg.retry_s, cfg.failed_retry_s, cfg.retry_max_s, cfg.recheck_s, cfg.alert_after_errors) == \
        (30, 300, 900, 3600, 3)


async def test_a_failed_pair_is_retried_with_backoff_and_comes_back_when_right(empty_config, caplog):
    caplog.set_level(logging.INFO, "gateway.cluster.fidelity")
    c = Cluster(fidelity={"failed_retry_s": 0.1, "retry_max_s": 0.2})
    c.decode.fidelity_error = 1.7
    await c.start()
    try:
        async def retried() -> bool:
            return c.decode.canaries >= 3
        await c.wait_for(retried)
        row = await fidelity_row(c)
        assert row["state"] == "failed" and not row["usable"] and row["next_check_s"] is not None
        (warn,) = _messages(caplog, logging.WARNING)  # once when it fell, not once per retry
        assert "FAILED: K layer 3 rel. error 1.7" in warn and "prefill on decode-0 instead" in warn
        assert any("FAILED" in m for m in _messages(caplog, logging.INFO))
        c.decode.fidelity_error = 1e-5  # fixed (a node's fault mended without a restart)

        async def verified() -> bool:
            return (await fidelity_row(c))["state"] == "verified"
        await c.wait_for(verified)
        assert await chat_path(c) == "disaggregated"
        assert any("verified again (it had failed)" in m for m in _messages(caplog, logging.INFO))
    finally:
        await c.stop()


async def test_errors_have_their_own_gauge_value_and_alert_when_repeated(empty_config, caplog):
    caplog.set_level(logging.WARNING, "gateway.cluster.fidelity")
    c = Cluster(fidelity={"retry_s": 0.05, "retry_max_s": 0.05, "alert_after_errors": 2})
    c.decode.mode = "kv_capacity"
    await c.start()
    try:
        async def alerted() -> bool:
            return bool(_messages(caplog, logging.ERROR))
        await c.wait_for(alerted)
        row = await fidelity_row(c)
        assert row["state"] == "error" and not row["usable"] and row["errors"] >= 2
        assert await c.metric("disagg_kv_fidelity", **PAIR) == -2  # not -1: pending is another state
        assert await c.metric("disagg_kv_fidelity_errors", **PAIR) >= 2
        err = _messages(caplog, logging.ERROR)[0]
        assert "could not be checked (2 in a row, alert after 2)" in err and "429" in err
        assert "prefill on decode-0 until it is verified" in err
        c.decode.mode = None

        async def verified() -> bool:
            return (await fidelity_row(c))["state"] == "verified"
        await c.wait_for(verified)
        assert await c.metric("disagg_kv_fidelity_errors", **PAIR) == 0
    finally:
        await c.stop()


async def test_a_verified_pair_is_checked_again_every_recheck_s_and_stays_usable_meanwhile(empty_config):
    c = Cluster(fidelity={"recheck_s": 0.2})
    c.decode.canary_hold = hold = asyncio.Event()
    hold.set()
    await c.start()
    try:
        async def rechecked() -> bool:
            return c.decode.canaries >= 2
        await c.wait_for(rechecked)
        hold.clear()  # the next re-check hangs: the pair goes on meanwhile

        async def checking() -> bool:
            return (await fidelity_row(c))["checking"]
        await c.wait_for(checking)
        row = await fidelity_row(c)
        assert row["state"] == "verified" and row["usable"]
        assert await chat_path(c) == "disaggregated"
        hold.set()
    finally:
        await c.stop()


@pytest.mark.parametrize("usable", [True, False])
async def test_an_override_decides_with_its_reason_shown(empty_config, caplog, usable):
    caplog.set_level(logging.WARNING, "gateway.cluster.fidelity")
    reason = "MXFP4 Spark vs 4-bit Mac: figures checked by hand, 2026-11"
    c = Cluster(fidelity={"override": [{"prefill": "prefill-0", "usable": usable, "reason": reason}]})
    c.decode.fidelity_error = 0.0 if not usable else 1.7  # the override wins over either verdict
    await c.start()
    try:
        (row,) = await c.wait_fidelity()
        assert row["state"] == ("failed" if usable else "verified")  # the canary still runs and is shown
        assert row["usable"] is usable and row["override"] == {"usable": usable, "reason": reason}
        assert await chat_path(c) == ("disaggregated" if usable else "local")
        assert await c.metric("disagg_kv_fidelity_usable", **PAIR) == (1 if usable else 0)
        warns = _messages(caplog, logging.WARNING)
        assert any("overridden" in m and reason in m for m in warns)
        if usable:
            assert any("FAILED" in m and f"still used by [[fidelity.override]]: {reason}" in m for m in warns)
    finally:
        await c.stop()


def test_an_override_must_name_known_nodes_and_say_why(empty_config):
    d, p = FakeDecodeNode("decode-0"), FakePrefillNode("prefill-0", [])
    d.port = p.port = 1
    with pytest.raises(ValidationError, match="prefill node 'spark-9'"):
        make_settings([d], [p], fidelity={"override": [{"prefill": "spark-9", "reason": "x"}]})
    with pytest.raises(ValidationError, match="needs its reason"):
        make_settings([d], [p], fidelity={"override": [{"decode": "decode-0", "reason": " "}]})
    s = make_settings([d], [p], fidelity={"override": [{"decode": "decode-0", "reason": "ok"}]})
    assert s.fidelity.override_for(MODEL_ID, "prefill-0", "decode-0").reason == "ok"
    assert s.fidelity.override_for(MODEL_ID, "prefill-0", "decode-1") is None


async def test_a_figure_measured_across_a_node_change_is_not_taken(cluster, caplog):
    """The decode node restarts while a canary runs: that canary's figure is the old process's; the pair is measured
    again before it carries KV."""
    caplog.set_level(logging.INFO, "gateway.cluster.fidelity")
    await cluster.wait_fidelity()
    cluster.decode.canary_hold = hold = asyncio.Event()
    cluster.decode.kv_digest = "kv1"

    async def checking() -> bool:
        return (await fidelity_row(cluster))["state"] == "checking"
    await cluster.wait_for(checking)
    cluster.decode.boot_id = "another-process"

    async def seen() -> bool:
        async with cluster.http.get(cluster.url + "/health") as r:
            return {n["name"]: n.get("boot_id") for n in (await r.json())["nodes"]}["decode-0"] == "another-process"
    await cluster.wait_for(seen)
    hold.set()

    async def verified() -> bool:
        return (await fidelity_row(cluster))["state"] == "verified"
    await cluster.wait_for(verified)
    assert cluster.decode.canaries == 3  # the first, the one across the restart (not taken), the new process's
    assert any("a node changed while the canary ran" in m for m in _messages(caplog, logging.INFO))
