"""The decode node's canary step (backends/decode/canary.py run + verdict) on a tiny llama's real mlx-lm caches, KV as
the receiver hands it: the whole canary as KV, and through the prefix-reuse path (a held prefix of MLX's own, the KV
after it appended); a right KV verifies with its head named, a wrong one fails naming layer, head and metric."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.support.kv_pairs import drive, own_kv, received


@pytest.fixture(scope="module")
def node_model(llama_q4):
    import mlx.core as mx

    return SimpleNamespace(model=llama_q4.full, dtype=mx.float32, kv_bits=None, kv_group_size=64,
                           path=str(llama_q4.path))


def _received(model, ids, start, wire="float32", swap=False):
    """What the receiver hands the canary: KV of ids[start:], computed here by MLX (as vLLM would), via `wire`."""
    k, v = (a[:, :, start:] for a in own_kv(model, ids))
    return received(*((v, k) if swap else (k, v)), start, wire, chunk=32)


@pytest.mark.parametrize("prefix", [0, 40])
@pytest.mark.parametrize("wire", ["float32", "float8_e4m3"])
def test_a_right_kv_verifies_whole_or_appended_to_a_held_prefix(node_model, prefix, wire):
    from backends.decode.canary import run, verdict

    ids = [int(t) for t in np.random.default_rng(3).integers(3, 3000, 100)]
    kv = _received(node_model.model, ids[:-1], prefix, wire)
    out = drive(run(node_model, ids, kv, 3, prefix))
    v = verdict("m", "decode-0", "float32", wire, len(ids) - 1, out)
    assert v.state == "verified" and v.findings == [], v.summary()
    assert v.head is not None and v.metric == "rel. RMS" and v.error <= v.tolerance and v.weights == "full"


def test_a_swapped_kv_through_the_prefix_path_fails_and_is_named(node_model):
    from backends.decode.canary import run, verdict

    ids = [int(t) for t in np.random.default_rng(4).integers(3, 3000, 100)]
    out = drive(run(node_model, ids, _received(node_model.model, ids[:-1], 40, swap=True), 3, 40))
    v = verdict("m", "decode-0", "float32", "float32", len(ids) - 1, out)
    assert v.state == "failed" and v.metric == "placement" and v.head is not None
    assert "better than its own slot" in v.message and f"layer {v.layer} head {v.head}" in v.summary()


def _steps(gen) -> tuple[int, dict]:
    n = 0
    while True:
        try:
            next(gen)
            n += 1
        except StopIteration as done:
            return n, done.value


def test_the_reference_is_one_forward_and_quantized_weights_get_no_greedy_steps(node_model):
    """Issue #50: a busy batch step between each of the canary's steps must not stretch it: MLX's own prefill is one
    forward (one step), the comparison the next; greedy steps only where both sides hold the same weights."""
    from backends.decode.canary import run

    ids = [int(t) for t in np.random.default_rng(5).integers(3, 3000, 100)]
    steps, out = _steps(run(node_model, ids, _received(node_model.model, ids[:-1], 0), 3))
    assert steps == 1 + 1 + 3 and out["greedy"] == "3/3"  # reference, then (yield) the greedy steps
    steps, out = _steps(run(node_model, ids, _received(node_model.model, ids[:-1], 0), 3, weights="4", measure=True))
    assert steps == 1 and out["greedy"] is None and out["kl"] is None and out["weights"] == "4"
    assert 0 <= out["excess"] < 0.05 and out["excess_at"]["tensor"] in ("K", "V")  # float32 both sides: nothing
    steps, _ = _steps(run(node_model, ids, _received(node_model.model, ids[:-1], 40), 3, 40, weights="8"))
    assert steps == 2  # the held prefix's own forward, then the reference's


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_the_drafters_kv_is_judged_as_more_layers_without_failing_the_pair(node_model, tmp_path, method):
    """A drafter's KV with the canary (the prefill node ran an EAGLE-3 head or a DFlash drafter): right, it passes on
    the fp8 wire too; scaled, it is named as a drafter layer (after the model's), and the pair stays verified (drafts
    are verified: answers are safe)."""
    from backends.decode.canary import run, verdict
    from backends.decode.speculative.dflash import dflash_prompt_kv, untrained_dflash
    from backends.decode.speculative.eagle3 import untrained_eagle3
    from backends.decode.speculative.eagle3_source import head_prompt_kv
    from backends.decode.speculative.hidden import target_args
    from backends.decode.speculative.learned_load import load_learned
    from kv_bridge.mlx.fidelity_metric import wire_encode

    target = target_args(node_model.model)
    make = {"eagle3": untrained_eagle3, "dflash": untrained_dflash}[method]
    tap, head = load_learned(method, make(target, str(tmp_path / "h")), node_model.model)
    m = SimpleNamespace(**{**vars(node_model), "model": tap, "draft_model": head, "model_id": "m"})
    ids, wire = [int(t) for t in np.random.default_rng(7).integers(3, 3000, 80)], "float8_e4m3"
    if method == "eagle3":
        k, v = (a[None] for a in head_prompt_kv(head, tap, ids))
    else:
        k, v = dflash_prompt_kv(head, tap, ids)
    for scale, clean in ((1.0, True), (1.5, False)):
        kv = _received(node_model.model, ids[:-1], 0, wire)
        kv.draft_keys, kv.draft_values = (np.stack([wire_encode(x, wire, 32) for x in a]) for a in (k, v * scale))
        out = drive(run(m, ids, kv, 3))
        n = len(out["layers"])
        assert n <= out["draft"]["layer"] < n + len(k) and not out["findings"]
        assert (not out["draft"]["findings"]) == clean, out["draft"]
        assert all(f["layer"] >= n for f in out["draft"]["findings"])
        assert verdict("m", "d", "float32", wire, len(ids), out).state == "verified"


def test_a_calibrated_gain_band_judges_the_heads_and_the_verdict_says_so(node_model):
    """The pair's band (from an honest canary's own per-head gains, as calibrate writes it) rides into the judge:
    an honest canary verifies under it, one V head x0.85 fails on that head; a band of another shape is refused."""
    from backends.decode.canary import run, verdict
    from kv_bridge.fidelity import gain_band

    ids = [int(t) for t in np.random.default_rng(6).integers(3, 3000, 100)]
    honest = drive(run(node_model, ids, _received(node_model.model, ids[:-1], 0), 3, weights="4"))
    band = gain_band([honest["layers"]])
    out = drive(run(node_model, ids, _received(node_model.model, ids[:-1], 0), 3, weights="4", band=band))
    v = verdict("m", "decode-0", "float32", "float32", len(ids) - 1, out)
    assert v.ok and v.gain_band and not v.over_allowance, v.summary()
    kv = _received(node_model.model, ids[:-1], 0)
    kv.values[:, 1] *= 0.85
    v = verdict("m", "decode-0", "float32", "float32", len(ids) - 1,
                drive(run(node_model, ids, kv, 3, weights="4", band=band)))
    assert v.state == "failed" and (v.tensor, v.head, v.metric) == ("V", 1, "|gain - band mid|"), v.summary()
    with pytest.raises(ValueError, match="calibrate"):
        drive(run(node_model, ids, _received(node_model.model, ids[:-1], 0), 3, weights="4", band=band[:1]))


def test_a_gain_band_of_another_form_is_refused_at_the_door():
    from backends.common import NodeError
    from backends.decode.canary import _band

    assert _band(None) is None and _band([{"k": [[0.9], [1.0]], "v": [[0.8], [1.0]]}])
    for bad in ([], [{"k": [[0.9]], "v": []}], [{"k": [[0.9], [1.0, 1.1]], "v": [[0.8], [1.0]]}], "band"):
        with pytest.raises(NodeError, match="gain_band must be"):
            _band(bad)


@pytest.fixture(scope="module")
def oss_model(tmp_path_factory):
    """A tiny gpt_oss whose sliding layers hold 16 tokens (mlx-lm RotatingKVCache), its weights the same both sides."""
    import mlx.core as mx
    from mlx_lm import load

    from tests.support import tiny_models

    folder = tiny_models.build("gpt_oss", tmp_path_factory.mktemp("oss") / "m", window=16)
    model, _ = load(str(folder))
    return SimpleNamespace(model=model, dtype=mx.float32, kv_bits=None, kv_group_size=64, path=str(folder))


def _windowed(model, ids, start, swap=False):
    """KV of ids[start:] as a prefill node sends it for a sliding-window model: a sliding layer only its window (the
    receiver's placeholders, zeros, before it: ReceivedKV.layer_first says where it starts)."""
    k, v = (np.ascontiguousarray(a[:, :, start:]) for a in own_kv(model, ids))
    total, window = len(ids), model.args.sliding_window
    sliding = [i for i, t in enumerate(model.args.layer_types) if t == "sliding_attention"]
    first = np.array([max(start, total - window) if i in sliding else start for i in range(k.shape[0])])
    for i in sliding:
        k[i, :, :first[i] - start] = 0
        v[i, :, :first[i] - start] = 0
    return received(*((v, k) if swap else (k, v)), start, "float8_e4m3", chunk=32, first=first)


def test_a_held_prefix_with_a_sliding_windows_kv_appended_verifies_and_a_wrong_one_fails(oss_model):
    """The prefix round on a sliding-window model (the seed site's gpt-oss:tiny after a restart): the window's
    placeholders the append leaves (no step attends to them) are not compared, so the right KV verifies, decodes
    as MLX alone does, and a swapped one still fails."""
    from backends.decode.canary import run, verdict

    ids = [int(t) for t in np.random.default_rng(6).integers(3, 3000, 160)]
    out = drive(run(oss_model, ids, _windowed(oss_model.model, ids[:-1], 80), 6, 80))
    v = verdict("m", "decode-0", "float32", "float8_e4m3", len(ids) - 1, out)
    assert v.state == "verified" and v.findings == [] and out["greedy"] == "6/6", v.summary()
    out = drive(run(oss_model, ids, _windowed(oss_model.model, ids[:-1], 80, swap=True), 3, 80))
    assert verdict("m", "decode-0", "float32", "float32", len(ids) - 1, out).state == "failed"
