"""A decode node's memory, item by item: what `disagg config check` budgets, the decode node compares with Metal's
wired limit at start (backends/decode/mac_memory.py) and `disagg doctor` reports. The formulas and the allowances' sources
are in docs/deploy.md ("The Mac's memory budget")."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kv_bridge.config.models import ModelRoute, resolve_model_path
from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings
from kv_bridge.dtypes import itemsize

GIB = 2**30
# mlx-lm's BatchGenerator prefills each prompt in chunks of prefill_step_size tokens (2048, mlx_lm/generate.py), up
# to prefill_batch_size prompts side by side; batch.py keeps the step and sets that to min(8, max_batch_size)
PREFILL_STEP = 2048
PREFILL_BATCH = 8
# Metal's fused attention for a chunk (query length > 8) at these head dims keeps the scores in on-chip tiles; other
# head dims (192 and 256 too: MLX routes them unfused) materialize them (mlx scaled_dot_product_attention.cpp)
FUSED_HEAD_DIMS = {64, 72, 80, 96, 128}
# The process beside its MLX buffers: Python, mlx, mlx-lm, aiohttp. Measured: a decode node serving SmolLM2 here is
# 1.12 GiB resident (`ps -o rss`) with 0.50 GiB of weights, so 0.62; rounded up. Each model adds its tokenizer and
# llguidance's token tables (150-200k-token vocabularies on the site): an allowance, not measured here.
PROCESS_GIB = 0.75
PROCESS_PER_MODEL_GIB = 0.5
# A logged-in macOS session beside the node (WindowServer, Finder, Dock, Spotlight): an allowance; reserved_gib is
# macOS itself and its file cache. Log out (the LaunchDaemon runs without a session) to get it back.
SESSION_GIB = 2.0
GRADING_TOKENS = 25_000  # the longest grading prompt (rubric + notebook, DESIGN.md's workload)
# What a Mac must keep free beyond every counted item, or config check fails it: the allowances above are estimates
# (process, session), Metal rounds buffers to pages and MLX's allocator fragments; 2 GiB is 2% of a 96 GB Mac.
HEADROOM_GIB = 2.0

# Geometry of the published checkpoints the site serves, for a machine without the folder (config check on a
# laptop): the hub's config.json fields the budget reads, by the repo id a [[models]] alias names.
PUBLISHED = {
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": {
        "model_type": "qwen3_moe", "torch_dtype": "bfloat16", "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8},
    "openai/gpt-oss-120b": {
        "model_type": "gpt_oss", "torch_dtype": "bfloat16", "hidden_size": 2880, "num_hidden_layers": 36,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
        "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18},
}
PUBLISHED["Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8"] = PUBLISHED["Qwen/Qwen3-Coder-30B-A3B-Instruct"]


def weights(route: ModelRoute, role: str, base: Path) -> tuple[float | None, str]:
    """(GiB, where from): the side's folder measured when it is here (its *.safetensors), else the declared
    {role}_weights_gib, else (None, "unknown")."""
    declared = route.prefill_weights_gib if role == "prefill" else route.decode_weights_gib
    folder = resolve_model_path(route, base)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        cfg = None
    # One path holds each machine's own format: a quantized MLX folder ("quantization", mlx-lm's key) is the decode
    # side's only; an unquantized or vLLM-quantized HF folder is measured for either side.
    if cfg is not None and not ("quantization" in cfg and role == "prefill"):
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / GIB
        if size:
            return size, f"measured at {folder}"
    if declared is not None:
        return declared, f"declared {role}_weights_gib (no folder at {folder} here)"
    return None, "unknown"


def geometry(route: ModelRoute, base: Path) -> tuple[dict | None, str]:
    """(config.json fields, where from): the folder's config.json, else a published checkpoint an alias names."""
    folder = resolve_model_path(route, base)
    try:
        cfg = json.loads((folder / "config.json").read_text())
        return cfg.get("text_config", cfg) | {"torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype")}, str(folder)
    except (OSError, ValueError):
        pass
    for name in (*route.aliases, route.id):
        if name in PUBLISHED:
            return PUBLISHED[name], f"{name}'s published config.json"
    return None, "unknown"


def kv_per_token(cfg: dict) -> tuple[int, str]:
    """(bytes one token's KV takes at full length over every layer, dtype) as the decode node holds it."""
    dtype = cfg.get("torch_dtype") if cfg.get("torch_dtype") in ("float16", "bfloat16", "float32") else "float32"
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    item = itemsize(dtype)
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * item, dtype


def prefill_peak_bytes(cfg: dict, max_len: int) -> int:
    """Peak activations of one prompt's chunked local prefill at its last chunk (C tokens against max_len keys):
    C x (3 hidden + 2 heads x head_dim + 2 kv_heads x head_dim + MLP) x itemsize, the MLP being 3 x intermediate
    (dense) or top_k x (2 hidden + 3 x expert intermediate) plus float32 router logits (MoE); the attention scores,
    C x max_len x 1 B (the batch cache's bool mask) where Metal fuses them, else heads x C x max_len x 4 B; and one
    layer's K and V copied as the cache grows, 2 x kv_heads x head_dim x max_len x itemsize."""
    per_token, dtype = kv_per_token(cfg)
    item = itemsize(dtype)
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    c = min(PREFILL_STEP, max_len)
    if experts:
        top_k = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
        inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        mlp, router = top_k * (2 * hidden + 3 * inter), c * experts * 4
    else:
        mlp, router = 3 * cfg["intermediate_size"], 0
    act = c * (3 * hidden + 2 * heads * head_dim + 2 * kv * head_dim + mlp) * item + router
    scores = c * max_len if head_dim in FUSED_HEAD_DIMS else heads * c * max_len * 4
    return act + scores + 2 * kv * head_dim * max_len * item


@dataclass
class DecodeBudget:
    items: list[tuple[str, float]]  # (what, GiB)
    unknown: list[str]  # models whose weight size is not known here
    notes: list[str] = field(default_factory=list)  # where each figure came from


def decode_budget(s: Settings, node: NodeConfig, routes: list[ModelRoute], base: Path) -> DecodeBudget:
    """Everything a decode node holds: weights, prefix caches, in-flight KV, the receive pool, a chunked local
    prefill of the longest prompt per model, MLX's buffer cache, the process and a logged-in session."""
    items, unknown, notes, local = [], [], [], 0.0
    for r in routes:
        gib, src = weights(r, "decode", base)
        if gib is None:
            unknown.append(r.id)
        else:
            items.append((f"{r.id} weights", gib))
        notes.append(f"{r.id} weights: {src}")
        cfg, where = geometry(r, base)
        if cfg is None:
            notes.append(f"{r.id} local prefill: no config.json here nor a published alias: not counted")
            continue
        try:
            full = kv_per_token(cfg)[0] * (r.max_model_len - 1)
            peak = prefill_peak_bytes(cfg, r.max_model_len)
        except KeyError as e:
            notes.append(f"{r.id} local prefill: {where} has no {e}: not counted")
            continue
        # prompts prefilled side by side: a fallback prefills what a transfer reserved, so no more than in flight
        n = max(1, min(PREFILL_BATCH, s.decode.max_batch_size, s.kv.max_inflight_bytes // full))
        local += n * peak / GIB
        notes.append(f"{r.id} local prefill: {n} x {r.max_model_len} tokens in chunks of {PREFILL_STEP} (geometry: "
                     f"{where})")
    for r in routes:
        items += draft_items(r, base, notes)
    proc = PROCESS_GIB + PROCESS_PER_MODEL_GIB * len(routes)
    prefix = "prefix cache" if len(routes) == 1 else f"prefix caches ({len(routes)} models)"
    items += [(prefix, len(routes) * s.decode.prefix_cache_bytes / GIB),
              ("in-flight KV", s.kv.max_inflight_bytes / GIB), ("receive pool", s.kv.pool_bytes / GIB),
              ("local prefill", local), ("MLX cache", s.decode.mlx_cache_limit_bytes / GIB),
              ("process", proc), ("session", SESSION_GIB)]
    gen, join, more = answer_items(s, node, routes, base)
    items += [("generated KV", gen), ("batch join copy", join)]
    return DecodeBudget(items, unknown, notes + more)


def _held_per_token(cfg: dict, tokens: int) -> float:
    """Bytes per token MLX holds for a `tokens`-long sequence: gpt-oss's sliding layers keep only their window."""
    per_token = kv_per_token(cfg)[0]
    window = cfg.get("sliding_window")
    sliding = sum(t == "sliding_attention" for t in cfg.get("layer_types", [])) if window else 0
    layers = cfg["num_hidden_layers"]
    return per_token * ((layers - sliding) * tokens + sliding * min(window or tokens, tokens)) / layers / tokens


def answer_items(s: Settings, node: NodeConfig, routes: list[ModelRoute], base: Path) -> tuple[float, float, list]:
    """(generated KV GiB, batch join copy GiB, notes). Generated: each model's answers at once (max_batch_size, no
    more than its [[models]] max_inflight) x answer_tokens of KV beyond the prompt (a sliding layer adds none past
    its window). Join: mlx-lm's BatchKVCache.extend pads the batch and the joining prompt to one length and
    concatenates them, a new copy of the whole batch beside the old until it is freed; the largest is a model's
    grading batch (grading_capacity's at_once) of GRADING_TOKENS + answer_tokens each. One MLX thread joins one
    prompt at a time, so the largest model's counts, not the sum."""
    gen, join, notes = 0.0, 0.0, []
    caps = {c["model"]: c for c in grading_capacity(s, node, routes, base)}
    for r in routes:
        cfg, _ = geometry(r, base)
        if cfg is None or r.id not in caps:
            notes.append(f"{r.id} generated KV and batch join: no geometry here: not counted")
            continue
        per_token, layers = kv_per_token(cfg)[0], cfg["num_hidden_layers"]
        window = cfg.get("sliding_window")
        sliding = sum(t == "sliding_attention" for t in cfg.get("layer_types", [])) if window else 0
        n = min(s.decode.max_batch_size, r.max_inflight or s.decode.max_batch_size)
        g = n * r.answer_tokens * per_token * (layers - sliding) / layers / GIB
        length = GRADING_TOKENS + r.answer_tokens
        j = caps[r.id]["at_once"] * length * _held_per_token(cfg, length) / GIB
        gen, join = gen + g, max(join, j)
        notes.append(f"{r.id} generated KV: {n} answers x {r.answer_tokens} tokens ({g:.2f} GiB); batch join: "
                     f"{caps[r.id]['at_once']} x {length} tokens copied ({j:.2f} GiB)")
    return gen, join, notes


def draft_items(route: ModelRoute, base: Path, notes: list[str]) -> list[tuple[str, float]]:
    """A speculative draft model's weights and its own cache of the longest prompt (it prefills every prompt itself,
    docs/speculative.md), for a model whose speculative.method is "draft"; measured from its folder. The same for a
    learned drafter ("eagle3", "dflash": its config.json names its layers, KV heads and head_dim the same way)."""
    sp = route.speculative
    if not {"draft", "auto", "eagle3", "dflash"} & set(sp.sources) or not sp.draft_path:
        return []
    folder = Path(sp.draft_path).expanduser()
    folder = folder if folder.is_absolute() else base / folder
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        notes.append(f"{route.id} draft: no config.json at {folder}: not counted (disagg models prepare --role draft)")
        return []
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / GIB
    notes.append(f"{route.id} draft: measured at {folder}")
    try:
        kv = kv_per_token(cfg)[0] * route.max_model_len / GIB
    except KeyError:
        return [(f"{route.id} draft weights", size)]
    return [(f"{route.id} draft weights", size), (f"{route.id} draft KV ({route.max_model_len} tokens)", kv)]


def grading_capacity(s: Settings, node: NodeConfig, routes: list[ModelRoute], base: Path,
                     tokens: int = GRADING_TOKENS) -> list[dict]:
    """Per model on this node: how many `tokens`-token prompts decode at once. The bound is what the receiver
    reserves (every layer at full length, tokens - 1: the last is run on the Mac) against kv.max_inflight_bytes,
    capped by [decode] max_batch_size; `held` is what MLX keeps once decoding (gpt-oss's sliding layers: window)."""
    out = []
    for r in routes:
        cfg, _ = geometry(r, base)
        if cfg is None:
            continue
        per_token, dtype = kv_per_token(cfg)
        reserved = per_token * (tokens - 1)
        window = cfg.get("sliding_window")
        sliding = sum(t == "sliding_attention" for t in cfg.get("layer_types", [])) if window else 0
        layers = cfg["num_hidden_layers"]
        held = per_token * ((layers - sliding) * tokens + sliding * min(window or tokens, tokens)) // layers
        by_kv = s.kv.max_inflight_bytes // reserved
        out.append({"node": node.name, "model": r.id, "tokens": tokens, "dtype": dtype,
                    "reserved_gib": round(reserved / GIB, 3), "held_gib": round(held / GIB, 3),
                    "by_kv": by_kv, "max_batch": s.decode.max_batch_size,
                    "at_once": min(by_kv, s.decode.max_batch_size)})
    return out
