"""Issue #50 in the gateway's fidelity lifecycle, over fake nodes: a verified pair whose decode node restarts with
the same KV identity carries KV provisionally at once (its re-check running) and is demoted when the re-check
fails; a changed identity is never provisional; the canary is told the prefill side's weights and the pair's
calibrated allowance while both identities are the ones it was measured on."""

from __future__ import annotations

import asyncio
import logging

from kv_bridge.config.fidelity import FidelityCalibration, write_calibration
from tests.support.fakes import MODEL_ID, Cluster, chat_body


async def _row(c: Cluster) -> dict:
    async with c.http.get(c.url + "/health") as r:
        (row,) = (await r.json())["fidelity"]
    return row


async def _path(c: Cluster) -> str:
    status, headers, body = await c.chat(chat_body("x " * 60))
    assert status == 200, body
    return headers["x-disagg-path"]


async def test_a_restart_with_the_same_kv_identity_carries_kv_provisionally_and_a_failed_recheck_demotes(
        cluster, caplog):
    caplog.set_level(logging.WARNING, "gateway.cluster.fidelity")
    await cluster.wait_fidelity()
    cluster.decode.canary_hold = hold = asyncio.Event()
    cluster.decode.boot_id = "b2" * 16  # kill -9 and back: a new process, the same digest

    async def rechecking() -> bool:
        row = await _row(cluster)
        return row["state"] == "provisional" and row["checking"]
    await cluster.wait_for(rechecking)
    row = await _row(cluster)
    assert row["usable"] and "decode-0 restarted" in row["summary"] and "until its re-check" in row["summary"]
    assert await cluster.metric("disagg_kv_fidelity", model=MODEL_ID, prefill="prefill-0", decode="decode-0") == 0.5
    assert await _path(cluster) == "disaggregated"  # not sent local while the busy Mac gets to its canary

    cluster.decode.fidelity_error = 0.5  # the re-check finds the KV wrong
    hold.set()

    async def demoted() -> bool:
        return (await _row(cluster))["state"] == "failed"
    await cluster.wait_for(demoted)
    assert not (await _row(cluster))["usable"] and await _path(cluster) == "local"
    assert any("FAILED (demoted: it carried KV provisionally after a restart)" in r.getMessage()
               for r in caplog.records)
    assert any("decode-0 restarted" in r.getMessage() and "carries KV provisionally while it is checked again"
               in r.getMessage() for r in caplog.records)


async def test_a_restart_with_another_kv_identity_is_not_provisional(cluster):
    await cluster.wait_fidelity()
    cluster.decode.canary_hold = asyncio.Event()
    cluster.decode.boot_id, cluster.decode.kv_digest = "b3" * 16, "kv9"

    async def checking() -> bool:
        return (await _row(cluster))["state"] == "checking"
    await cluster.wait_for(checking)
    assert not (await _row(cluster))["usable"] and await _path(cluster) == "local"
    cluster.decode.canary_hold.set()


async def test_the_canary_is_told_the_prefill_weights_and_a_calibration_of_these_identities(
        empty_config, tmp_path):
    path = tmp_path / "cal.json"
    c = Cluster(fidelity={"calibration_file": str(path)})
    c.prefills[0].weights = {"scheme": "fp8", "bits": 8}
    await c.start()
    try:
        assert c.decode.canary_bodies[-1] == {"model": MODEL_ID, "prefill": "prefill-0",
                                              "prefill_weights": {"scheme": "fp8", "bits": 8}}
        band = [{"k": [[0.9, 0.88], [1.0, 0.99]], "v": [[0.85, 0.8], [0.95, 0.93]]}]
        cal = dict(model=MODEL_ID, prefill="prefill-0", decode="decode-0", allowance=0.5, weights="4",
                   prefill_kv="kv0", decode_kv="kv0", date="2026-11-28T06:40:00Z", reason="20 canaries",
                   gain_band=band)
        write_calibration(path, FidelityCalibration(**cal))
        status, _, body = await c.post("/fidelity")
        row = body["pairs"][0]
        assert status == 200 and row["calibration"]["allowance"] == 0.5 and row["gain_band"]
        assert row["calibration"]["gain_band"].startswith("gain band 1 layers x 2 KV heads, [0.8, 1]")
        assert c.decode.canary_bodies[-1]["allowance"] == 0.5 and c.decode.canary_bodies[-1]["gain_band"] == band
        write_calibration(path, FidelityCalibration(**{**cal, "decode_kv": "kv-old"}))  # another Mac build: expired
        status, _, body = await c.post("/fidelity")
        assert body["pairs"][0]["calibration"] is None and not body["pairs"][0]["gain_band"]
        assert "allowance" not in c.decode.canary_bodies[-1] and "gain_band" not in c.decode.canary_bodies[-1]
    finally:
        await c.stop()
