"""The KV fidelity canary without engines: its comparison on real mlx-lm caches of tiny models (a right KV against a
swapped or transposed one), its verdict and tolerances, and the gateway's use of it over fake nodes (a failed pair
goes local, a pair is checked again after a node was down, on demand, and only a verified one while required)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.support import tiny_models
from tests.support.fakes import Cluster, chat_body
from tests.support.kv_pairs import drive
from kv_bridge.fidelity import KL_TOLERANCE, TOLERANCE, FidelityConfig, Verdict, kl_tolerance, tolerance




# ---- the comparison, on mlx-lm's own caches ----

@pytest.fixture(scope="module", params=["llama", "gpt_oss"])
def tiny(request, tmp_path_factory):
    """(model, canary ids): a tiny llama (KVCache) and a tiny gpt_oss whose sliding layers hold 16 tokens."""
    from mlx_lm import load

    kw = {"window": 16} if request.param == "gpt_oss" else {}
    folder = tiny_models.build(request.param, tmp_path_factory.mktemp(request.param) / "m", **kw)
    model, _ = load(str(folder))
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 200, 48)]
    return model, ids


def _bridged(model, ids, swap=False, transpose=False):
    """The cache a decode node builds from KV a prefill node sent for `ids`: here MLX's own one-shot prefill of them
    (cache_kv), possibly mangled as a wrong layout adapter would mangle it, through the bridge's build_prompt_cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import build_prompt_cache, cache_kv

    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    keys, values = cache_kv(cache, len(ids))  # (L, H, T, D) float32
    if swap:
        keys, values = values, keys
    if transpose:  # K read as [D, block] where it was [block, D]: same shape only when T == D
        keys = np.ascontiguousarray(keys[:, :, ::-1])
    return build_prompt_cache(model, keys, values)


def test_a_right_kv_compares_within_float32_rounding(tiny):
    from kv_bridge.mlx import fidelity

    model, ids = tiny
    reference = drive(fidelity.prefill(model, ids[:-1], chunk=8))  # chunked, as on the MLX thread
    figures = fidelity.compare(_bridged(model, ids[:-1]), reference, model=model)
    layers = figures["layers"]
    assert len(layers) == len(model.layers) and figures["findings"] == []
    worst = max(max(r["k"], r["v"], r["k_max"], r["v_max"]) for r in layers)
    assert worst < TOLERANCE["float32"], layers
    assert {r["tokens"] for r in layers} <= {len(ids) - 1, 16}  # a sliding layer compares its window
    steps = drive(fidelity.greedy(model, _bridged(model, ids[:-1]), reference, ids[-1], 6))
    assert steps["agree"] == steps["steps"] == 6 and steps["kl"] < 1e-4, steps


@pytest.mark.parametrize("fault", ["swap", "transpose"])
def test_a_wrong_layout_is_far_past_every_tolerance(tiny, fault):
    from kv_bridge.mlx import fidelity

    model, ids = tiny
    reference = drive(fidelity.prefill(model, ids[:-1]))
    bridged = _bridged(model, ids[:-1], **{fault: True})
    figures = fidelity.compare(bridged, reference, model=model)
    layers = figures["layers"]
    assert max(max(r["k_max"], r["v_max"]) for r in layers) > max(TOLERANCE.values()) * 3, layers
    assert figures["findings"] and figures["worst"] is figures["findings"][0], figures["worst"]
    steps = drive(fidelity.greedy(model, bridged, reference, ids[-1], 4))
    assert steps["kl"] > 0, steps  # a random tiny model's distributions are near flat: the KV says more here


def test_prefill_never_ends_on_a_one_token_step(tiny):
    """A 1-token update rotates a sliding cache out of temporal order; the lone last token joins the step before."""
    from kv_bridge.mlx import fidelity

    model, ids = tiny
    cache = drive(fidelity.prefill(model, ids[:17], chunk=8))  # 17 = 8 + 8 + 1
    assert fidelity.compare(cache, _bridged(model, ids[:17]))  # compares: every cache still in temporal order


def test_tolerance_is_the_coarser_dtype_and_unknown_is_refused():
    assert tolerance("float32", "float32") == TOLERANCE["float32"]
    assert tolerance("float8_e4m3", "bfloat16") == TOLERANCE["float8_e4m3"]
    assert tolerance("float32", "bfloat16") == TOLERANCE["bfloat16"]
    assert kl_tolerance("bfloat16", "float32") == KL_TOLERANCE["bfloat16"]
    with pytest.raises(ValueError, match="uint32"):
        tolerance("float32", "uint32")


def test_a_near_tie_flipped_by_rounding_passes_a_changed_distribution_fails():
    """The tiny random gpt_oss of `make site` flips its first greedy token under bf16 + fp8 (its logits are near
    flat) with its KV well within tolerance: the KL decides, not the argmax."""
    from backends.decode.canary import verdict

    layers = [{"layer": 0, "k": 0.05, "v": 0.04, "tokens": 160}]
    worst = {"metric": "rel. RMS", "tensor": "K", "layer": 0, "head": 1, "value": 0.05, "tolerance": 0.2}
    out = {"layers": layers, "findings": [], "worst": worst, "seconds": 1.0}
    ok = verdict("m", "d", "float32", "float8_e4m3", 160, {**out, "greedy": "0/8", "kl": 0.004})
    assert ok.state == "verified" and ok.greedy == "0/8"
    assert ok.summary().startswith("verified: worst K layer 0 head 1 rel. RMS 0.05 (tolerance 0.2)")
    bad = verdict("m", "d", "float32", "float8_e4m3", 160, {**out, "greedy": "1/8", "kl": 3.0})
    assert bad.state == "failed" and "next-token KL 3 over 0.2" in bad.summary()
    # Different weights on the two sides: the KL measures the weights as much as the KV, evidence only.
    mixed = verdict("m", "d", "float32", "float8_e4m3", 160, {**out, "greedy": "1/8", "kl": 0.3, "weights": "4"})
    assert mixed.state == "verified" and mixed.kl == 0.3


def test_verdict_round_trips_and_says_what_failed():
    v = Verdict("m", "p", "d", "failed", 1.7, 3, "K", 0.01, "float32", "float32", 136, "0/8", 2.0)
    assert Verdict.from_json(v.to_json()) == v
    assert not v.ok and v.summary().startswith("failed: worst K layer 3 rel. error 1.7 (tolerance 0.01)")
    assert Verdict("m", "p", "d", "error", message="KV did not arrive").summary() == \
        "not checked: KV did not arrive"
    assert FidelityConfig().required and FidelityConfig().canary_tokens == 256


def test_status_table_shows_each_pair_and_marks_what_is_not_verified():
    from backends.cli.status import render

    ok = Verdict("m", "p0", "d0", "verified", 1.1e-5, 20, "V", 0.01, "float32", "float32", 136, "4/4", 9.0, kl=1e-6)
    bad = Verdict("m", "p0", "d1", "failed", 16.0, 0, "V", 0.01, "float32", "float32", 136, "0/4", 9.0, kl=3.1)
    down = Verdict("m", "p1", "d0", "error", message="node down")
    lines = render({"nodes": [], "links": [], "fidelity": [ok, bad, down]}).splitlines()
    (head,) = [ln for ln in lines if "KV FIDELITY" in ln]
    assert "WORST" in head and "GREEDY" in head and "KL" in head
    good, failed, gone = (next(ln for ln in lines if f"{v.prefill} -> {v.decode}" in ln) for v in (ok, bad, down))
    assert good.startswith("   ") and "verified" in good and "V layer 20" in good and "1.1e-05" in good
    assert failed.startswith("!! ") and "FAILED" in failed and "V layer 0" in failed and "3.1" in failed
    assert gone.startswith("!! ") and "node down" in gone


def test_a_verdict_from_real_traffic_has_no_figure_and_says_what_it_found():
    """The gateway's demotion after a request's KV failed the decode node's layer-0 check (kv_bridge/mlx/traffic.py)."""
    from backends.cli.status import render

    v = Verdict("m", "p0", "d0", "failed", metric="real-traffic position error",
                message="a request's KV failed the decode node's layer-0 check: K layer 0 position 650 error 1.4")
    assert v.summary() == "failed: " + v.message
    (line,) = [ln for ln in render({"nodes": [], "links": [], "fidelity": [v]}).splitlines() if "p0 -> d0" in ln]
    assert "FAILED" in line and "position 650" in line


# ---- the gateway over fake nodes ----

async def _path(c: Cluster) -> str:
    status, headers, body = await c.chat(chat_body("x " * 60))
    assert status == 200, body
    return headers["x-disagg-path"]


async def test_a_failed_pair_goes_local_and_says_so_everywhere(empty_config, caplog):
    caplog.set_level(logging.WARNING, "gateway.cluster.fidelity")
    c = Cluster()
    c.decode.fidelity_error = 1.7
    await c.start()
    try:
        (row,) = await c.wait_fidelity()
        assert (row["state"], row["usable"], row["layer"], row["tensor"]) == ("failed", False, 3, "K")
        assert await _path(c) == "local" and c.prefill.requests == []
        assert await c.metric("disagg_kv_fidelity", model="smollm2:135m", prefill="prefill-0",
                              decode="decode-0") == 0
        assert await c.metric("disagg_kv_fidelity_error", model="smollm2:135m", prefill="prefill-0",
                              decode="decode-0") == 1.7
        (warn,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert "FAILED: K layer 3 rel. error 1.7" in warn and "prefill-0 -> decode-0" in warn
        async with c.http.get(c.url + "/health") as r:
            assert r.status == 200 and (await r.json())["fidelity"][0]["state"] == "failed"
    finally:
        await c.stop()


async def test_a_verified_pair_is_disaggregated_and_checked_again_after_a_node_restarted(cluster):
    (row,) = await cluster.wait_fidelity()
    assert row["state"] == "verified" and row["usable"] and row["greedy"] == "8/8"
    assert await _path(cluster) == "disaggregated"
    assert cluster.decode.canaries == 1
    cluster.decode.down = True
    cluster.decode.boot_id = "restarted"  # it comes back as another process

    async def seen_down() -> bool:
        async with cluster.http.get(cluster.url + "/health") as r:
            return not (await r.json())["nodes"][0]["up"]
    await cluster.wait_for(seen_down)
    cluster.decode.down = False

    async def checked_again() -> bool:  # the old process's verdict does not stand for the new one
        return cluster.decode.canaries == 2
    await cluster.wait_for(checked_again)
    (row,) = await cluster.wait_fidelity()
    assert row["state"] == "verified" and cluster.decode.canaries == 2
    assert await _path(cluster) == "disaggregated"


async def test_on_demand_the_canary_runs_again(cluster):
    await cluster.wait_fidelity()
    status, _, body = await cluster.post("/fidelity")
    assert status == 200 and [r["state"] for r in body["pairs"]] == ["verified"]
    assert cluster.decode.canaries == 2
    status, _, body = await cluster.post("/fidelity?model=nope")
    assert status == 404 and "nope" in body["error"]["message"]


async def test_a_canary_that_could_not_run_keeps_the_pair_local_until_it_can(empty_config):
    c = Cluster(fidelity={"retry_s": 0.2})
    c.decode.mode = "kv_error"  # every transfer fails on the decode side: no verdict on the values
    await c.start()
    try:
        (row,) = await c.wait_fidelity()
        assert row["state"] == "error" and not row["usable"] and "KV did not arrive" in row["summary"]
        assert await _path(c) == "local"
        c.decode.mode = None

        async def verified() -> bool:
            return (await c.wait_fidelity())[0]["state"] == "verified"
        await c.wait_for(verified)
        assert await _path(c) == "disaggregated"
    finally:
        await c.stop()


async def test_not_required_an_unchecked_pair_is_used_but_a_failed_one_never(empty_config):
    c = Cluster()
    c.decode.fidelity_error = 1.7
    await c.start()
    try:
        checks = c.settings.fidelity
        checks.required = False
        assert await _path(c) == "local"  # failed: never, required or not
        checks.enabled = False
        assert await _path(c) == "disaggregated"  # canary off: every pair is used
    finally:
        await c.stop()
