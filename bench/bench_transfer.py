"""KV transfer over loopback: KVSender -> KVReceiver (real frames, real sockets) vs a raw TCP stream of the same bytes.

Run from the repository root:  .venv/bin/python -m bench.bench_transfer [--reps 5] [--sizes 1024,4096,8192]
    [--no-profile]
The receiver runs in this process as on a decode node (a loop thread accepts, each connection is read on a thread
of its own), the sender from the main thread (its writer thread sends), as on the nodes. A profile follows (skip
it with --no-profile): where the time goes, and what the frames' checksums cost (a what-if with them
stubbed out). On the site the two ends are separate machines: bench/bench_link.py measures over an emulated link.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import threading
import time
from contextlib import contextmanager

import numpy as np
import xxhash

from kv_bridge import wire
from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver, Transfer
from kv_bridge.sender import KVSender, _Writer
from tests.support.stack import free_port

L, H, D = 30, 3, 64  # SmolLM2: float32 on the wire, as the embedded model stores it
SPEC = {"fingerprint": "bench", "num_layers": L, "num_kv_heads": H, "head_dim": D}


def target(n: int) -> float:
    return 0.8 if n <= 1024 else 0.9  # the median ratio to raw to reach: fixed costs weigh most at 1k tokens


class LoopThread:
    """An asyncio loop on its own thread, as a decode node runs its receiver (connections are read on their own)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-loop", daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def kv_layers(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-layer contiguous (H, n, D) K and V, as the extractor hands them to the sender."""
    rng = np.random.default_rng(seed)
    return [(rng.random((H, n, D), dtype=np.float32), rng.random((H, n, D), dtype=np.float32)) for _ in range(L)]


def bridge_once(lt: LoopThread, rx: KVReceiver, sender: KVSender, port: int, layers, tag: str) -> tuple[float, int]:
    """Seconds from open() until the receiver holds the complete KV, and the payload bytes it counted."""
    n = layers[0][0].shape[1]

    async def expect():
        return rx.expect(tag, n, SPEC)

    t = lt.call(expect())
    hdr = wire.StreamHeader(transfer_id=tag, fingerprint=SPEC["fingerprint"], num_layers=L, num_kv_heads=H,
                            head_dim=D, dtype="float32", start=0, num_tokens=n)
    t0 = time.perf_counter()
    sender.open(hdr, "127.0.0.1", port)
    for i, (k, v) in enumerate(layers):
        sender.send_layer(tag, i, 0, k, v)
    sender.close(tag)
    got = lt.call(t.result(120))
    dt = time.perf_counter() - t0
    lt.loop.call_soon_threadsafe(rx.forget, tag)  # the request is over, as the decode node says it
    got.release()  # as the decode node does once MLX has copied the KV: the buffers serve the next transfer
    return dt, got.nbytes


@contextmanager
def ends(lt: LoopThread, rx: KVReceiver, sender: KVSender):
    """A receiver listening on loopback (its port yielded) and a sender; both stopped on the way out."""
    port = free_port()
    lt.call(rx.start("127.0.0.1", port))
    try:
        yield port
    finally:
        sender.shutdown()
        lt.call(rx.stop())


class RawReceiver:
    """The raw baseline's receiving end: a plain thread, blocked in accept() before any clock starts, that reads
    `nbytes` from one connection into a preallocated buffer with recv_into."""

    def __init__(self, host: str, nbytes: int):
        self.nbytes, self.port, self.done = nbytes, free_port(), threading.Event()
        self.srv = socket.create_server((host, self.port))
        self.dest = bytearray(nbytes)
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            view, got = memoryview(self.dest), 0
            while got < self.nbytes:
                r = conn.recv_into(view[got:], min(self.nbytes - got, 1 << 20))
                if r == 0:
                    raise RuntimeError("raw sender closed early")
                got += r
        self.done.set()

    def close(self) -> None:
        self.thread.join()
        self.srv.close()


def raw_send(host: str, port: int, payload: memoryview, nbytes_per_layer: int) -> socket.socket:
    """The raw baseline's sending end: a connection that has written `payload` with one sendall per layer-sized
    chunk (the caller closes it)."""
    s = socket.create_connection((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(L):
        s.sendall(payload[i * nbytes_per_layer:(i + 1) * nbytes_per_layer])
    return s


def raw_once(nbytes_per_layer: int, payload: bytes) -> float:
    """Seconds to move L * nbytes_per_layer bytes: sendall per layer-sized chunk, recv_into a preallocated buffer."""
    rx = RawReceiver("127.0.0.1", L * nbytes_per_layer)
    t0 = time.perf_counter()
    with raw_send("127.0.0.1", rx.port, memoryview(payload), nbytes_per_layer):
        rx.done.wait(120)
    dt = time.perf_counter() - t0
    rx.close()
    return dt


class TimedReceiver(KVReceiver):
    """KVReceiver whose frame checks and KV assembly are timed (profiling only; same code paths): the checksum
    through `wire.check_checksum` and `wire.kv_digest`, assembly through `Transfer.add` (float32 frames are
    received in place and never reach it), both called from each connection's thread."""

    def __init__(self, cfg: KVConfig):
        super().__init__(cfg)
        self.t = {"checksum check": 0.0, "assemble (Transfer.add)": 0.0}
        self._check = wire.check_checksum

        def timed_check(ftype, parts, got):
            t0 = time.perf_counter()
            try:
                return self._check(ftype, parts, got)
            finally:
                self.t["checksum check"] += time.perf_counter() - t0
        wire.check_checksum = timed_check
        self._digest = wire.kv_digest
        wire.kv_digest = lambda first: _TimedDigest(self._digest(first), self.t)  # in-place frames, per piece

    def restore(self) -> None:
        wire.check_checksum, wire.kv_digest = self._check, self._digest

    def expect(self, transfer_id, num_tokens, spec):
        t = super().expect(transfer_id, num_tokens, spec)
        t.__class__ = TimedTransfer
        t.times = self.t
        return t


class _TimedDigest:
    def __init__(self, digest, times: dict):
        self.digest, self.times = digest, times

    def update(self, piece) -> None:
        t0 = time.perf_counter()
        self.digest.update(piece)
        self.times["checksum check"] += time.perf_counter() - t0

    def intdigest(self) -> int:
        return self.digest.intdigest()


class TimedWriter(_Writer):
    """A destination's writer thread, timed: hashing each piece (wire.frame_batches) vs sendmsg (profiling only)."""

    def _write(self, st, tid, batches):
        def timed():
            it = iter(batches)
            while True:
                t0 = time.perf_counter()
                batch = next(it, None)
                self.s.t["hash (checksum or tag)"] += time.perf_counter() - t0
                if batch is None:
                    return
                yield batch
        t0, before = time.perf_counter(), self.s.t["hash (checksum or tag)"]
        super()._write(st, tid, timed())
        self.s.t["sendmsg"] += time.perf_counter() - t0 - (self.s.t["hash (checksum or tag)"] - before)


class TimedSender(KVSender):
    """KVSender whose writers are timed."""
    writer_cls = TimedWriter

    def __init__(self):
        self.t = {"hash (checksum or tag)": 0.0, "sendmsg": 0.0}
        super().__init__()


class TimedTransfer(Transfer):
    def add(self, hdr, layer, start, k, v):
        t0 = time.perf_counter()
        super().add(hdr, layer, start, k, v)
        self.times["assemble (Transfer.add)"] += time.perf_counter() - t0


def micro(nbytes: int, reps: int = 5) -> dict[str, float]:
    """GB/s of single pieces of the path on a buffer of one frame's size (no sockets)."""
    buf = np.random.default_rng(2).random(nbytes // 4, dtype=np.float32).tobytes()
    dst = np.empty(nbytes // 4, np.float32)
    ba = bytearray()

    def best(fn):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return nbytes / min(ts) / 1e9

    def grow():  # what StreamReader does: extend a bytearray chunk by chunk, then bytes() it out
        ba.clear()
        for i in range(0, nbytes, 1 << 18):
            ba.extend(memoryview(buf)[i:i + (1 << 18)])
        bytes(ba)

    return {"xxh3_64 (KV frame checksum)": best(lambda: xxhash.xxh3_64_intdigest(buf)),
            "bytes(memoryview) copy": best(lambda: bytes(memoryview(buf))),
            "bytearray grow + bytes()": best(grow),
            "np.frombuffer + copy to preallocated": best(lambda: np.copyto(dst, np.frombuffer(buf, np.float32)))}


def fill_rates(layers, reps: int = 3) -> dict[str, float]:
    """GB/s of writing every layer's K into an (L, H, T, D) buffer: fresh per transfer (as Transfer.begin) or reused."""
    shape = (L, *layers[0][0].shape)
    reused = np.ones(shape, np.float32)

    def fill(dst):
        for i, (k, _) in enumerate(layers):
            dst[i] = k

    def best(make):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fill(make())
            ts.append(time.perf_counter() - t0)
        return reused.nbytes / min(ts) / 1e9
    return {"fill fresh np.empty (L, H, T, D)": best(lambda: np.empty(shape, np.float32)),
            "fill reused (L, H, T, D) buffer": best(lambda: reused)}


class _NoHash:
    """A running checksum that hashes nothing (what-if only: a stream checked by it is not checked at all)."""

    def update(self, piece) -> None:
        pass

    def intdigest(self) -> int:
        return 0


def without_hashing(lt: LoopThread, n: int, reps: int) -> None:
    """What the frames' integrity check costs here: the bridge as it is vs the same with both sides' xxh3 stubbed
    out, interleaved (the stubbed stream sends and checks a checksum of 0)."""
    layers = kv_layers(n, seed=5)
    rx, sender, kept = KVReceiver(KVConfig()), KVSender(), (wire._running_checksum, wire.kv_digest)
    times = {"as it is": [], "xxh3 stubbed out (unsafe)": []}
    with ends(lt, rx, sender) as port:
        for i in range(reps + 1):
            for label in times:
                if label != "as it is":
                    wire._running_checksum = lambda ftype: _NoHash() if ftype == wire.KV else kept[0](ftype)
                    wire.kv_digest = lambda first: _NoHash()
                try:
                    dt, _ = bridge_once(lt, rx, sender, port, layers, f"nohash-{label[:2]}-{i}")
                finally:
                    wire._running_checksum, wire.kv_digest = kept
                if i:  # the first round warms both up
                    times[label].append(dt)
    print(f"  the frames' checksums, {n} tokens, {reps} bridge transfers each, interleaved (median ms):")
    for label, ts in times.items():
        print(f"    {label:<40}{statistics.median(ts) * 1e3:7.1f}")


def profile(lt: LoopThread, n: int, reps: int) -> None:
    layers = kv_layers(n, seed=9)
    frame = layers[0][0].nbytes * 2
    rx, sender = TimedReceiver(KVConfig()), TimedSender()
    total = 0.0
    try:
        with ends(lt, rx, sender) as port:
            for i in range(reps):
                dt, _ = bridge_once(lt, rx, sender, port, layers, f"prof-{n}-{i}")
                total += dt
    finally:
        rx.restore()
    print(f"\nprofile, {n} tokens ({frame / 1e6:.1f} MB frames), {reps} bridge transfers, {total:.3f} s wall in all:")
    print("  receiver connection thread, summed over frames:")
    for k, v in rx.t.items():
        print(f"    {k:<26}{v:8.3f} s  {v / total * 100:5.1f}% of wall")
    print("  sender writer thread, summed over frames (sendmsg includes waiting for the receiver):")
    for k, v in sender.t.items():
        print(f"    {k:<26}{v:8.3f} s  {v / total * 100:5.1f}% of wall")
    print(f"  pieces alone on one {frame / 1e6:.1f} MB frame (best of 5, GB/s, no sockets; buffers warm in cache):")
    for k, v in micro(frame).items():
        print(f"    {k:<40}{v:7.2f}")
    print(f"  receive buffers ({L * frame / 2e6:.0f} MB of K, best of 3, GB/s): page faults of a fresh buffer per transfer:")
    for k, v in fill_rates(layers).items():
        print(f"    {k:<40}{v:7.2f}")
    without_hashing(lt, min(1024, n), 9)  # at 1k tokens: where the bridge falls shortest of the raw socket


def run(sizes: list[int], reps: int) -> tuple[list[dict], LoopThread]:
    lt = LoopThread()
    rx, sender = KVReceiver(KVConfig()), KVSender()
    rows = []
    with ends(lt, rx, sender) as port:
        for n in sizes:
            layers = kv_layers(n)
            per_layer = layers[0][0].nbytes + layers[0][1].nbytes
            payload = np.concatenate([np.concatenate([k.ravel(), v.ravel()]) for k, v in layers]).tobytes()
            bridge_once(lt, rx, sender, port, layers, f"warm-{n}")  # first-touch and connection set-up
            raw_once(per_layer, payload)
            tb, tr = [], []
            for i in range(reps):  # interleaved, so both see the same machine load
                dt, got = bridge_once(lt, rx, sender, port, layers, f"b-{n}-{i}")
                if got != L * per_layer:
                    raise SystemExit(f"receiver counted {got} bytes, sent {L * per_layer}")
                tb.append(dt)
                tr.append(raw_once(per_layer, payload))
            rows.append({"n": n, "bytes": L * per_layer, "bridge": tb, "raw": tr})
            print(f"  {n:>5} tok: bridge " + " ".join(f"{t * 1e3:.0f}" for t in tb) + " ms; raw "
                  + " ".join(f"{t * 1e3:.0f}" for t in tr) + " ms", flush=True)
    return rows, lt


def report(rows: list[dict], reps: int) -> None:
    print(f"\nmachine: nproc {len(os.sched_getaffinity(0))} (shared: numbers are noisy); loopback TCP; {L} layers x "
          f"(K, V) of ({H}, T, {D}) float32, one frame per layer; {reps} reps each, interleaved; medians (and bests)")
    print(f"{'tokens':>7}{'MB':>8}{'bridge ms':>11}{'GB/s':>7}{'raw ms':>9}{'GB/s':>7}{'ratio':>8}"
          f"{'best ratio':>12}  target")
    for r in rows:
        b, w = statistics.median(r["bridge"]), statistics.median(r["raw"])
        ratio, best = w / b, min(r["raw"]) / min(r["bridge"])
        print(f"{r['n']:>7}{r['bytes'] / 1e6:>8.1f}{b * 1e3:>11.1f}{r['bytes'] / b / 1e9:>7.2f}{w * 1e3:>9.1f}"
              f"{r['bytes'] / w / 1e9:>7.2f}{ratio:>7.2f}x{best:>11.2f}x  >= {target(r['n'])}x {'ok' if ratio >= target(r['n']) else 'MISS'}")
    print("ratio = raw time / bridge time (bridge GB/s over raw GB/s); bridge time: open() until the receiver holds "
          "all layers as float32 (L, H, T, D)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="1024,4096,8192")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = ap.parse_args()
    if args.smoke:
        args.reps, args.sizes = 1, "1024"
    sizes = [int(s) for s in args.sizes.split(",")]
    print("transfers (ms per run):", flush=True)
    rows, lt = run(sizes, args.reps)
    report(rows, args.reps)
    if not args.no_profile:
        profile(lt, max(sizes), 3)
    lt.close()


if __name__ == "__main__":
    main()
