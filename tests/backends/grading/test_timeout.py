"""Latency against the app's client timeout (backends/grading/timeout.py): the report's figures and its count past the
timeout, the highest concurrency none passes, `bench grading --predict` over a list of concurrencies, and the replay
against a gateway whose answers take longer than a (short) client timeout: those requests are counted past it."""

from __future__ import annotations

import asyncio
import json

from backends.grading import replay as grading
from backends.grading import timeout as gt
from tests.support import ROOT
from tests.support.fakes import MODEL_ID, Cluster


def test_report_counts_past_the_timeout_and_the_abandoned():
    rep = gt.latency_report([10.0, 20.0, 30.0, 400.0], 300.0)
    assert rep == {"timeout_s": 300.0, "requests": 4, "median_s": 25.0, "p95_s": 344.5, "max_s": 400.0,
                   "past_timeout": 1}
    gave_up = gt.latency_report([10.0], 300.0, gave_up=2)
    assert gave_up["past_timeout"] == 2 and gave_up["requests"] == 3 and gave_up["max_s"] == 300.0


def test_highest_concurrency_within_the_timeout():
    rows = {2: {"past_timeout": 0}, 4: {"past_timeout": 0}, 8: {"past_timeout": 3}, 16: {"past_timeout": 0}}
    assert gt.highest_within(rows) == 4  # 16 comes after a concurrency that already passed it
    assert gt.highest_within({2: {"past_timeout": 1}}) is None
    assert "no request passes the client's 300 s: 4" in gt.verdict(rows, 300)


def test_predict_over_a_list_of_concurrencies(tmp_path, capsys):
    from backends.cli.main import main

    out = tmp_path / "p.json"
    rc = main(["bench", "grading", "--predict", "--config", str(ROOT / "examples" / "site-seeds.toml"),
               "--concurrency", "2,8,32", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    result = json.loads(out.read_text())
    rows = {int(c): p["split"]["latency"] for c, p in result["by_concurrency"].items()}
    assert sorted(rows) == [2, 8, 32] and all(r["requests"] == 120 and r["timeout_s"] == 300 for r in rows.values())
    assert rows[2]["past_timeout"] == 0 < rows[32]["past_timeout"]  # the app's two fit; 32 at once do not
    assert rows[2]["median_s"] <= rows[2]["p95_s"] <= rows[2]["max_s"] < 300
    assert result["highest_within_timeout"] == gt.highest_within(rows) == 8
    assert "highest concurrency at which no request passes the client's 300 s: 8" in text
    assert "concurrency   2     split: latency median" in text


async def test_the_replay_counts_answers_slower_than_the_client_waits(empty_config):
    """A fake Mac that takes ~1 s an answer and a client that waits 0.3 s: each request is abandoned and counted past
    the timeout; with the app's 300 s none is."""
    c = await Cluster().start()
    try:
        c.decode.token_delay = 0.15
        calls = grading.workload(2, [MODEL_ID], scale=0.02, seed=0, concurrency=2)
        hasty = grading.Replay(c.url, None, progress=False, timeout=0.3)
        results, _ = await asyncio.to_thread(hasty.run, calls)
        rep = gt.measured(results, 0.3)
        assert rep["past_timeout"] == rep["requests"] == 4, [r.error for r in results]
        patient = grading.Replay(c.url, None, progress=False)
        results, _ = await asyncio.to_thread(patient.run, calls)
        rep = gt.measured(results)
        assert rep["past_timeout"] == 0 and rep["requests"] == 4 and 0 < rep["median_s"] <= rep["max_s"]
    finally:
        await c.stop()
