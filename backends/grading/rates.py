"""The rates the grading prediction (backends/grading/predict.py) runs on: the published ones of the real site's models
on its hardware (docs/deploy.md section 9, with their sources), or the running gateway's learned ones (/health) and a
decode rate measured by one short request per model (`make site`)."""

from __future__ import annotations

from pathlib import Path

from kv_bridge.config.settings import Settings
from kv_bridge.dtypes import itemsize

from backends.decode.budget import geometry, kv_per_token
from backends.decode.speculative.gain import SHAPES, decode_speedup
from backends.grading.predict import ModelRates, Route, Site

# docs/deploy.md section 9. Spark prefill: llama.cpp's DGX Spark benchmark (ggml-org/llama.cpp discussion 16578,
# pp2048 at depth): Qwen3-Coder-30B-A3B ~2.9k tok/s at 8k falling to ~1.3k at 32k, gpt-oss-120b ~1.75k to ~1.15k.
# Mac decode (M3 Ultra, MLX 4-bit): Qwen3-Coder ~76 tok/s short, 50-70 at 25k; gpt-oss-120b 40-80, lower with
# context (the middles below). Mac-alone prefill: EXO's Llama-3.1-8B 8k prompt, 5.57 s M3 Ultra vs 1.47 s Spark.
PUBLISHED_RATES = {
    "qwen3_moe": {"prefill": ((8192, 2900.0), (32768, 1300.0)), "decode": ((0, 76.0), (25000, 60.0))},
    "gpt_oss": {"prefill": ((8192, 1750.0), (32768, 1150.0)), "decode": ((0, 60.0), (25000, 55.0))},
}
MAC_ALONE_SLOWER = 5.57 / 1.47
LINK_10GBE = 1.1e9  # B/s of payload on 10GbE (docs/deploy.md section 9)
# One more generation in a Mac's batch costs this share of a single step: decode is memory-bound (the weights are read
# once per step for the whole batch). An assumption, not a published figure: measure it on the site.
MAC_BATCH_COST = 0.1
# Speculative decoding (prompt lookup, docs/speculative.md): a draft on 47% of steps, each drafted token kept with
# probability 0.75 until the first refusal: what bench/bench_spec.py measured on its grading-like prompts (SmolLM2-135M
# quoting a student's code: 23 verify steps of 49, 2.04 kept per verify step at k = 4). An assumption for 30B+ models
# quoting a 6-25k-token notebook; the verify forward's cost comes from what it reads (backends/decode/speculative/gain.py).
SPEC_ALPHA, SPEC_MATCH = 0.75, 0.47
SPEC_DEPTHS = (0, 6000, 12000, 18000, 25000, 32768)


def speculative_speedup(family: str) -> tuple[tuple[int, float], ...]:
    """A model's decode speedup by context depth, for a generation alone in its model's batch (1 where none pays)."""
    shape = SHAPES[family]
    return tuple((d, decode_speedup(shape, d, SPEC_ALPHA, SPEC_MATCH)[1]) for d in SPEC_DEPTHS)


def _geometry(settings: Settings, base: Path) -> dict[str, dict]:
    out = {}
    for r in settings.models:
        cfg, _ = geometry(r, base)
        if cfg is not None:
            out[r.id] = cfg
    return out


def _kv_bytes(cfg: dict | None, wire_dtype: str) -> tuple[float, float]:
    """(bytes per prompt token on the wire, reserved on the Mac in the model's dtype)."""
    if cfg is None:
        return 0.0, 0.0
    held, dtype = kv_per_token(cfg)
    wire = dtype if wire_dtype == "auto" else wire_dtype  # "auto": the KV crosses in the model's dtype
    return held / itemsize(dtype) * itemsize(wire), float(held)


def routes(settings: Settings) -> dict[str, Route]:
    return {r.id: Route(tuple(r.prefill), tuple(r.decode), r.max_inflight, r.min_disagg_tokens)
            for r in settings.models}


def published_site(settings: Settings, base: Path, speculative: bool = False,
                   roles: dict[str, str] | None = None) -> Site:
    """The config's topology at the published rates; a model of another family is a ValueError naming the known.
    `speculative`: a generation alone in its model's batch sped up as modelled: with `roles` (model id -> the call
    it answers, "analysis" | "feedback"), at the class replay's acceptance of that call and the verify cost fitted
    to the published rates (backends/grading/spec_predict.py); without, prompt lookup's (speculative_speedup)."""
    from backends.grading import spec_predict
    geo = _geometry(settings, base)
    rates = {}
    for r in settings.models:
        family = (geo.get(r.id) or {}).get("model_type")
        pub = PUBLISHED_RATES.get(family)
        if pub is None:
            raise ValueError(f"no published rates for model {r.id!r} (model_type {family!r}); known: "
                             f"{sorted(PUBLISHED_RATES)}: predict a site of other models from a running gateway")
        wire, held = _kv_bytes(geo.get(r.id), settings.kv.wire_dtype)
        local = tuple((d, v / MAC_ALONE_SLOWER) for d, v in pub["prefill"])
        if not speculative:
            spec = ((0, 1.0),)
        elif roles and r.id in roles:
            spec = spec_predict.speedup_points(family, roles[r.id], PUBLISHED_RATES)
        else:
            spec = speculative_speedup(family)
        rates[r.id] = ModelRates(pub["prefill"], local, pub["decode"], wire, held, spec_speedup=spec)
    return Site(routes(settings), rates, LINK_10GBE, settings.kv.max_inflight_bytes, settings.decode.max_batch_size,
                MAC_BATCH_COST)


def _value(table: dict, key: str, default: float) -> float:
    v = (table.get(key) or {}).get("value")
    return float(v) if v else default


def learned_site(settings: Settings, base: Path, health: dict, measured: dict[str, dict[str, float]],
                 batch_cost: float) -> Site:
    """The config's topology at the rates measured per model now (`measured`: decode, and prefill and ingest where
    the request went disaggregated), else the gateway's learned ones (its /health `rates`, priors until traffic)."""
    snap = health.get("rates") or {}
    cfg = settings.gateway.rates
    geo = _geometry(settings, base)
    links = [v["value"] for v in (snap.get("link_bytes_per_s") or {}).values() if v.get("value")]
    link = min(links) if links else cfg.link_bytes_per_s
    rates = {}
    for r in settings.models:
        pre = min((_value(snap.get("prefill_tokens_per_s", {}), n, cfg.prefill_tokens_per_s) for n in r.prefill),
                  default=cfg.prefill_tokens_per_s)
        local = min(_value(snap.get("local_prefill_tokens_per_s", {}), f"{n}/{r.id}", cfg.local_prefill_tokens_per_s)
                    for n in r.decode)
        ingest = min(_value(snap.get("ingest_tokens_per_s", {}), f"{n}/{r.id}", 20000.0) for n in r.decode)
        wire, held = _kv_bytes(geo.get(r.id), settings.kv.wire_dtype)
        wire = float((snap.get("kv_bytes_per_token") or {}).get(r.id) or wire)
        now = measured.get(r.id, {})
        rates[r.id] = ModelRates(((0, now.get("prefill", pre)),), ((0, now.get("local", local)),),
                                 ((0, now.get("decode", 10.0)),), wire, held, now.get("ingest", ingest))
    return Site(routes(settings), rates, link, settings.kv.max_inflight_bytes, settings.decode.max_batch_size,
                batch_cost)
