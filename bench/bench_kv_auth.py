"""What KV stream authentication costs: open vs header-only vs per-frame MACs, KVSender -> KVReceiver over loopback.

Run from the repository root:  .venv/bin/python -m bench.bench_kv_auth [--reps 5] [--sizes 4096] [--threshold 1.3]
Each run moves the same KV once per mode, back to back in rotating order (so all modes see the same machine load),
through long-lived receivers and senders as on the nodes; it prints the median of the runs' ratios to the open
transfer. Also prints the tag candidates' speed on one core of this CPU (what each side pays per byte).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import time

import blake3
import xxhash

from bench.bench_transfer import D, H, L, LoopThread, bridge_once, free_port, kv_layers
from kv_bridge.config.auth import AuthConfig
from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver
from kv_bridge.sender import KVSender

KEY = AuthConfig(node_secret="bench-secret-0123456789abcdef").kv_key()
MODES = {"open": (None, False), "header-only auth": (KEY, False), "per-frame MAC": (KEY, True)}


def rate(fn, data: memoryview, reps: int = 5) -> float:
    """GB/s, median of `reps` passes over `data`."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(data)
        ts.append(time.perf_counter() - t)
    return len(data) / statistics.median(ts) / 1e9


def tag_rates() -> None:
    data = memoryview(os.urandom(8 << 20))  # about one frame at 4k tokens
    rates = {"HMAC-SHA256": rate(lambda b: hmac.new(KEY, b, hashlib.sha256).digest(), data),
             "keyed BLAKE3": rate(lambda b: blake3.blake3(b, key=KEY).digest(), data),
             "xxh3_64 (KV frame checksum)": rate(xxhash.xxh3_64_intdigest, data)}
    print("one core, 8 MB buffer, median of 5: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()))


def run(lt: LoopThread, n: int, reps: int) -> dict[str, list[float]]:
    """Seconds per transfer of `n` tokens, per mode; one warm-up transfer each first (connections, pooled buffers)."""
    ends = {}
    for label, (key, fm) in MODES.items():
        rx, port = KVReceiver(KVConfig(), key, fm), free_port()
        lt.call(rx.start("127.0.0.1", port))
        ends[label] = (rx, port, KVSender(key=key, frame_mac=fm))
    layers = kv_layers(n)
    times: dict[str, list[float]] = {label: [] for label in MODES}
    try:
        for i in range(-1, reps):
            order = list(MODES)[i % 3:] + list(MODES)[:i % 3]
            for label in order:
                rx, port, sender = ends[label]
                dt, _ = bridge_once(lt, rx, sender, port, layers, f"{label}-{n}-{i}")
                if i >= 0:
                    times[label].append(dt)
    finally:
        for rx, _, sender in ends.values():
            sender.shutdown()
            lt.call(rx.stop())
    return times


def report(n: int, times: dict[str, list[float]], threshold: float) -> None:
    mb = 2 * L * H * n * D * 4 / 1e6
    print(f"\n{L} layers x {n} tokens, {mb:.0f} MB float32, one frame per layer ({mb / L:.1f} MB each); "
          f"{len(times['open'])} runs, medians")
    base = times["open"]
    for label, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        med = statistics.median(ratios)
        verdict = "" if label == "open" else ("  ok" if med <= threshold else f"  MISS (target <= {threshold}x)")
        print(f"  {label:18s} {statistics.median(ts) * 1e3:7.1f} ms  {mb / 1e3 / statistics.median(ts):5.2f} GB/s  "
              f"x{med:.2f} of open (runs: {' '.join(f'{r:.2f}' for r in ratios)}){verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="4096", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--threshold", type=float, default=1.3, help="per-frame MAC target, times the open transfer")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = ap.parse_args()
    if args.smoke:
        args.reps, args.sizes = 1, "1024"
    print(f"machine: nproc {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f} (shared: noisy)")
    tag_rates()
    lt = LoopThread()
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            report(n, run(lt, n, args.reps), args.threshold)
    finally:
        lt.close()


if __name__ == "__main__":
    main()
