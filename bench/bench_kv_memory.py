"""The decode node's KV memory per token, held in the model's dtype against float32 (the old receive path).

Run from the repository root:  .venv/bin/python -m bench.bench_kv_memory [--tokens 256] [--reps 5]
Real transfers over loopback (KVSender -> KVReceiver) in the site's geometries: what the receiver reserves and holds
per token, the mlx array it becomes, and how long the transfer takes per (wire dtype, held dtype), then each Mac's
capacity for 25k-token prompts under the site's kv.max_inflight_bytes (examples/site.toml).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.bench_transfer import LoopThread, ends
from kv_bridge import dtypes, wire
from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver
from kv_bridge.sender import KVSender

GIB = 2**30
SITE_INFLIGHT = 6710886400  # examples/site.toml's [kv] max_inflight_bytes when docs/kv_bridge.md's table was measured
PROMPT = 25_000
GEOMETRY = {"qwen3-coder:30b": (48, 4, 128), "gpt-oss:120b": (36, 8, 64)}  # layers, KV heads, head_dim
# (wire, held): the old receive path held every wire as float32; the site's wire is fp8 (examples/site.toml)
PATHS = [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"),
         ("float8_e4m3", "float32"), ("float8_e4m3", "bfloat16")]


def payload(x: np.ndarray, name: str) -> np.ndarray:
    if name == "float32":
        return x
    if name == "bfloat16":
        return dtypes.to_bfloat16(x)
    return dtypes.e4m3_encode(x, 1.0)


def once(lt, rx, port, geo, n, wire_dtype, target, tag):
    """(seconds until the receiver holds it, bytes held per token, bytes reserved per token, mlx bytes per token)."""
    import mlx.core as mx

    L, H, D = geo
    spec = {"fingerprint": "bench", "num_layers": L, "num_kv_heads": H, "head_dim": D}
    rng = np.random.default_rng(0)
    layers = [tuple(payload(rng.standard_normal((H, n, D), np.float32), wire_dtype) for _ in "kv") for _ in range(L)]

    async def expect():
        return rx.expect(tag, n, spec, dtype=target), rx.inflight_bytes
    t, reserved = lt.call(expect())
    sender = KVSender(max_bytes=4 << 30)
    t0 = time.perf_counter()
    sender.open(wire.StreamHeader(transfer_id=tag, fingerprint="bench", num_layers=L, num_kv_heads=H, head_dim=D,
                                  dtype=wire_dtype, start=0, num_tokens=n), "127.0.0.1", port)
    for i, (k, v) in enumerate(layers):
        sender.send_layer(tag, i, 0, k, v)
    sender.close(tag)
    got = lt.call(t.result(120))
    dt = time.perf_counter() - t0
    sender.shutdown()
    held = got.keys.nbytes + got.values.nbytes
    as_mx = mx.array(got.keys[0])
    as_mx = as_mx.view(mx.bfloat16) if target == "bfloat16" else as_mx
    mlx_per_token = 2 * L * as_mx.nbytes // n
    lt.loop.call_soon_threadsafe(rx.forget, tag)
    got.release()
    return dt, held // n, reserved // n, mlx_per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.reps = 16, 1
    lt = LoopThread()
    rx = KVReceiver(KVConfig(pool_bytes=0))
    print(f"machine: 2 shared cores, loopback; {args.tokens} tokens a transfer, {args.reps} reps (median ms)")
    print(f"{'model':16} {'wire -> held':24} {'held B/tok':>10} {'reserved':>9} {'mlx B/tok':>9} {'vs f32':>7} "
          f"{'ms':>7} {'25k GiB':>8} {'25k/Mac':>8}")
    with ends(lt, rx, KVSender()) as port:
        for model, geo in GEOMETRY.items():
            once(lt, rx, port, geo, args.tokens, "float32", "float32", f"{model}-warm-up")  # sockets, pages, imports
            base = None
            for wire_dtype, target in PATHS:
                runs = [once(lt, rx, port, geo, args.tokens, wire_dtype, target, f"{model}-{wire_dtype}-{target}-{r}")
                        for r in range(args.reps)]
                ms = statistics.median(r[0] for r in runs) * 1e3
                _, held, reserved, mlx_bytes = runs[0]
                base = base or held
                gib = reserved * PROMPT / GIB
                print(f"{model:16} {wire_dtype + ' -> ' + target:24} {held:>10} {reserved:>9} {mlx_bytes:>9} "
                      f"{held / base:>6.2f}x {ms:>7.1f} {gib:>8.2f} {int(SITE_INFLIGHT // (reserved * PROMPT)):>8}")
    lt.close()
    print(f"25k/Mac: {PROMPT}-token prompts in flight at once under kv.max_inflight_bytes = "
          f"{SITE_INFLIGHT / GIB:.2f} GiB (the receive buffers hold every layer at full length; gpt-oss's sliding "
          f"layers shrink to 128 tokens only in MLX's cache)")


if __name__ == "__main__":
    main()
