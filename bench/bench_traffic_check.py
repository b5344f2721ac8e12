"""The real-traffic KV check's cost per request (kv_bridge/mlx/traffic.py): layer 0 recomputed without attention and
every position tested, against MLX's own prefill of the same prompt measured in the same run; and the bytes gpt-oss's
whole layer 0 adds to a transfer (the sender's own header arithmetic, wire.StreamHeader.layer_start).

Run from the repository root:  .venv/bin/python -m bench.bench_traffic_check [--lengths 1024,4096] [--smoke]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kv_bridge import wire
from kv_bridge.assembly import ReceivedKV
from kv_bridge.mlx import traffic
from kv_bridge.mlx.fidelity_metric import wire_encode


def _run(gen):
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def _prefill_s(model, ids: list[int], step: int = 2048) -> float:
    """MLX's own prefill of `ids` (mlx-lm's default 2048-token steps), seconds."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for s in range(0, len(ids), step):
        model(mx.array(ids[s:s + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def _check_s(model, ids: list[int], wire_dtype: str, reps: int) -> tuple[float, bool]:
    """(best seconds of traffic.check on a right fp8 transfer of `ids`, whether it passed)."""
    k, v = _run(traffic.layer0_kv(model, ids, 0))
    keys, values = (wire_encode(x, wire_dtype, 64)[None] for x in (k, v))  # layer 0 is all the check reads
    best, ok = float("inf"), False
    for _ in range(reps):
        kv = ReceivedKV(0, keys, values, 0, 0.0, dtype="float32", wire_dtype=wire_dtype, layer_first=np.zeros(1, int))
        t0 = time.perf_counter()
        out = _run(traffic.check(model, ids, kv, wire_dtype, "full"))
        best, ok = min(best, time.perf_counter() - t0), out["ok"]
    return best, ok


def gpt_oss_extra(tokens: int) -> float:
    """Extra bytes of gpt-oss-120b's transfer with layer 0 whole (36 layers, even ones sliding over 128)."""
    def layer_tokens(window_layers: tuple[int, ...]) -> int:
        hdr = wire.StreamHeader("t", "f", 36, 8, 64, "bfloat16", 0, tokens, window=128, window_layers=window_layers)
        return sum(tokens - hdr.layer_start(x) for x in range(36))
    sliding = tuple(range(0, 36, 2))
    return layer_tokens(sliding[1:]) / layer_tokens(sliding) - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="1024,4096", help="prompt tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--wire", default="float8_e4m3")
    ap.add_argument("--smoke", action="store_true", help="a tiny llama, 256 tokens, once: the bench runs, no figure")
    args = ap.parse_args()
    from mlx_lm import load

    from tests.support import tiny_models
    from tests.support.stack import MODEL_DIR

    with tempfile.TemporaryDirectory() as d:
        path = tiny_models.build("llama", Path(d) / "m") if args.smoke else MODEL_DIR
        lengths = [256] if args.smoke else [int(x) for x in args.lengths.split(",")]
        model, _ = load(str(path))
        print(f"model {Path(path).name}, {len(model.layers)} layers, wire {args.wire}")
        rng = np.random.default_rng(0)
        for n in lengths:
            ids = [int(t) for t in rng.integers(3, 20000 if not args.smoke else 200, n)]
            check, ok = _check_s(model, ids, args.wire, 1 if args.smoke else args.reps)
            prefill = _prefill_s(model, ids)
            print(f"{n:>6} tokens: check {check * 1e3:8.1f} ms ({check * 1e3 / n * 1000:6.1f} ms per 1k tokens, "
                  f"{'passed' if ok else 'FAILED'}); MLX prefill {prefill:7.2f} s; check / prefill {check / prefill:.4f}"
                  f" (1/L = {1 / len(model.layers):.4f})", flush=True)
    for n in (8192, 25000):
        print(f"gpt-oss-120b, {n} tokens: layer 0 whole adds {gpt_oss_extra(n) * 100:.1f}% to the transfer's bytes")


if __name__ == "__main__":
    main()
