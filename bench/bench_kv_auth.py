"""What KV stream authentication costs: open vs header-only vs per-frame MACs, KVSender -> KVReceiver over loopback.

Run from the repository root:  .venv/bin/python bench/bench_kv_auth.py [--reps 3] [--tokens 4096]
Also prints HMAC-SHA256 and xxh3_64 throughput on this CPU, the per-byte cost each side pays per frame.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kv_bridge import wire  # noqa: E402
from kv_bridge.config import AuthConfig, KVConfig  # noqa: E402
from kv_bridge.receiver import KVReceiver  # noqa: E402
from kv_bridge.sender import KVSender  # noqa: E402
from tests.stack import free_port  # noqa: E402

L, H, D = 30, 3, 64  # SmolLM2, float32 on the wire
SPEC = {"fingerprint": "bench", "num_layers": L, "num_kv_heads": H, "head_dim": D}
KEY = AuthConfig(node_secret="bench-secret-0123456789abcdef").kv_key()


def rate(fn, data: memoryview, reps: int = 5) -> float:
    best = min(_timed(fn, data) for _ in range(reps))
    return len(data) / best / 1e9


def _timed(fn, data) -> float:
    t = time.perf_counter()
    fn(data)
    return time.perf_counter() - t


async def transfer(n: int, key: bytes | None, frame_mac: bool, kv) -> float:
    rx = KVReceiver(KVConfig(), key, frame_mac)
    port = free_port()
    await rx.start("127.0.0.1", port)
    keys, values = kv
    try:
        t = rx.expect("b", n, SPEC)
        t0 = time.perf_counter()

        def send():
            s = KVSender(max_bytes=64 << 20, key=key, frame_mac=frame_mac)
            s.open(wire.StreamHeader("b", "bench", L, H, D, "float32", 0, n), "127.0.0.1", port)
            for layer in range(L):
                s.send_layer("b", layer, 0, keys[layer], values[layer])
            s.close("b")
            s.flush()
            s.shutdown()

        await asyncio.gather(asyncio.to_thread(send), t.result(60))
        return time.perf_counter() - t0
    finally:
        await rx.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()

    data = memoryview(os.urandom(32 << 20))
    mac_rate = rate(lambda b: hmac.new(KEY, b, hashlib.sha256).digest(), data)
    sum_rate = rate(xxhash.xxh3_64_intdigest, data)
    print(f"HMAC-SHA256 {mac_rate:.2f} GB/s ({1e3 / mac_rate / 1e3:.2f} ms per MB), "
          f"xxh3_64 (KV frame checksum) {sum_rate:.2f} GB/s")

    n = args.tokens
    rng = np.random.default_rng(0)
    kv = tuple(rng.standard_normal((L, H, n, D), np.float32) for _ in range(2))
    mb = 2 * kv[0].nbytes / 1e6
    print(f"transfer: {L} layers x {n} tokens, {mb:.0f} MB, one frame per layer ({mb / L:.1f} MB each)")
    base = None
    for label, key, fm in (("open", None, False), ("header-only auth", KEY, False), ("per-frame MAC", KEY, True)):
        secs = statistics.median(asyncio.run(transfer(n, key, fm, kv)) for _ in range(args.reps))
        base = base or secs
        print(f"  {label:18s} {secs * 1e3:7.1f} ms  {mb / 1e3 / secs:5.2f} GB/s  x{secs / base:.2f} of open")


if __name__ == "__main__":
    main()
