"""`disagg bench spec`'s reading of a decode node (backends/grading/spec.py): the speculation counters and measured
costs parsed from the text a decode node's /metrics serves (backends/node_metrics.py over a real controller), and the
report's arithmetic. Through a running gateway and node: tests/backends/decode/speculative/test_speculative_e2e.py."""

from __future__ import annotations

import argparse

import httpx
import pytest
from prometheus_client import generate_latest

from backends.decode.speculative.control import Proposal, SpecController
from backends.grading.spec import scrape, summarize
from backends.node_metrics import DecodeMetrics
from kv_bridge.config.speculative import SpeculativeConfig


class _Model:
    def __init__(self, speculation):
        self.speculation, self.batch_size, self.cache_bytes = speculation, 1, 0
        self.prefixes = type("P", (), {"nbytes": 0})()

    def queued(self) -> int:
        return 0


def node_text() -> str:
    ctl = SpecController(SpeculativeConfig(method="prompt_lookup", cost_samples=2))
    p = Proposal("prompt_lookup", [1, 2, 3], 6)
    for emitted in ([1, 2, 9], [1, 2, 3, 4]):
        ctl.verified("prompt_lookup", 3, *ctl.observe(p, emitted, 3))
    ctl.plain()
    for _ in range(2):
        ctl.meter.add(1, 3000, 0.1)
        ctl.meter.add(4, 3000, 0.13)
    svc = type("S", (), {"models": {"m": _Model(ctl)}, "running": 0,
                         "receiver": type("R", (), {"transfers": {}, "inflight_bytes": 0})()})()
    return generate_latest(DecodeMetrics(svc).registry).decode()


def test_scrape_reads_the_decode_nodes_speculation():
    text = node_text()
    with httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(200, text=text))) as http:
        got = scrape(http, ["http://d0", "http://d1"], {}, "m")  # two nodes serving the model: summed
    assert (got["drafted"], got["accepted"], got["rejections"]) == (12, 10, 2)
    assert (got["verify"], got["plain"], got["probe"]) == (4, 2, 0)
    assert got["verify_cost"]["http://d0 k=3 2k-8k"] == pytest.approx(0.1)
    assert got["step_seconds"]["http://d1 rows=4 2k-8k"] == pytest.approx(0.13)
    with httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(200, text=text))) as http:
        assert scrape(http, ["http://d0"], {}, "other")["drafted"] == 0


def test_summary_ratios():
    def side(tokens, secs, **kw):
        return dict(tokens=tokens, decode_s=secs, response="x", drafted=0, accepted=0, rejections=0, verify=0,
                    plain=tokens, probe=0, **kw)
    rows = [{"role": "analysis", "off": side(100, 10.0), "on": {**side(100, 5.0), "drafted": 60, "accepted": 45,
                                                                "rejections": 5, "verify": 20, "plain": 35}}]
    res = summarize(rows, {"verify_cost": {}, "step_seconds": {}}, argparse.Namespace(model="m", sampled=False))
    assert res["ratio_on_off"] == pytest.approx(2.0) and res["equal_outputs"] == 1
    assert res["alpha"] == pytest.approx(0.9) and res["mean_k"] == 3 and res["kept_per_verify"] == 2.25
