"""A decode node that stops reading must not slow a concurrent transfer to a healthy one: time a healthy transfer
alone (baseline) and with a stalled transfer queued ahead of it on the same sender, interleaved in the same run.

Run from the repository root:  .venv/bin/python -m bench.bench_stall [--reps 5] [--tokens 512]
Healthy transfer: gpt-oss-120b-shaped (36 layers x 8 KV heads x 64), float32 wire, chunks of 128 tokens, real
sockets into the real receiver (its event loop in a thread of this process). Stalled receiver: accepts, ACKs the
header, never reads again; its transfer is as large and fails only at the send timeout (longer than the run).
Timed: from the healthy transfer's first frame queued to its KV complete at the receiver.
ratio = median(with stall) / median(alone); 1.00x means the stall costs the healthy transfer nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import numpy as np

from kv_bridge import wire
from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver
from kv_bridge.sender import KVSender
from tests.support.kv_sender import StalledReceiver
from tests.support.stack import free_port

L, H, D, CHUNK = 36, 8, 64, 128
SPEC = {"fingerprint": "bench", "num_layers": L, "num_kv_heads": H, "head_dim": D}


def send(sender: KVSender, tid: str, host_port: tuple[str, int], k: np.ndarray, v: np.ndarray) -> None:
    n = k.shape[2]
    sender.open(wire.StreamHeader(tid, "bench", L, H, D, "float32", 0, n), *host_port)
    for a in range(0, n, CHUNK):
        for layer in range(L):
            sender.send_layer(tid, layer, a, np.ascontiguousarray(k[layer, :, a:a + CHUNK]),
                              np.ascontiguousarray(v[layer, :, a:a + CHUNK]))
    sender.close(tid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = p.parse_args()
    if args.smoke:
        args.reps, args.tokens = 1, 64
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((L, H, args.tokens, D), np.float32) for _ in range(2))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    rx = KVReceiver(KVConfig())
    port = free_port()
    asyncio.run_coroutine_threadsafe(rx.start("127.0.0.1", port), loop).result()
    stalled = StalledReceiver()
    sender = KVSender(max_bytes=4 << 30, send_timeout_s=600.0)

    def healthy(i: int, stall: bool) -> float:
        t = asyncio.run_coroutine_threadsafe(_expect(rx, f"h{i}", args.tokens), loop).result()
        if stall:  # queued first, ahead of the healthy transfer; enqueueing it never waits (the bound is not hit)
            send(sender, f"s{i}", ("127.0.0.1", stalled.port), k, v)
        t0 = time.perf_counter()
        send(sender, f"h{i}", ("127.0.0.1", port), k, v)
        asyncio.run_coroutine_threadsafe(t.result(120), loop).result()
        dt = time.perf_counter() - t0
        asyncio.run_coroutine_threadsafe(_forget(rx, f"h{i}"), loop).result()
        return dt

    healthy(0, False)  # warm-up
    alone, with_stall = [], []
    for i in range(args.reps):
        alone.append(healthy(2 * i + 1, False))
        with_stall.append(healthy(2 * i + 2, True))
    a, s = statistics.median(alone), statistics.median(with_stall)
    mb = 2 * k.nbytes / 2**20
    print(f"healthy transfer {mb:.0f} MiB, median of {args.reps}: alone {a * 1e3:.0f} ms, with a stalled transfer "
          f"({sender.queued_bytes / 2**20:.0f} MiB still queued for it) {s * 1e3:.0f} ms   ratio {s / a:.2f}x")
    stalled.close()


async def _expect(rx: KVReceiver, tid: str, n: int):
    return rx.expect(tid, n, SPEC)


async def _forget(rx: KVReceiver, tid: str) -> None:
    rx.forget(tid)


if __name__ == "__main__":
    main()
