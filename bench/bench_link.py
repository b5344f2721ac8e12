"""KV over an emulated site link: raw socket vs the bridge, open and signed, each end in its own network namespace.

Run from the repository root as root (it needs `ip` and `tc` from iproute2):
    .venv/bin/python -m bench.bench_link [--rate 10gbit] [--mtu 1500] [--sizes 1024,4096,8192] [--reps 5] [--smoke]
On the site the prefill and decode nodes are separate machines joined by a link (10GbE between a DGX Spark and a
Mac Studio); loopback on one machine is no such link: its rate is the CPUs' copy rate, and both ends share them.
This bench puts the prefill end in a network namespace of its own, a child process (its own GIL, as a prefill
node's), joined to this process by a veth pair whose sending side is shaped to `--rate` with a token bucket (tc
tbf). The decode end (KVReceiver, or a plain thread for the raw baseline) runs here. Each rep moves the same KV
once per mode in rotating order; it prints medians and the ratio to the raw socket on the same link. The
namespace and its veth pair are removed on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from bench.bench_transfer import D, H, L, SPEC, LoopThread, RawReceiver, free_port, kv_layers, raw_send
from kv_bridge import wire
from kv_bridge.config.auth import AuthConfig
from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver
from kv_bridge.sender import KVSender

KEY = AuthConfig(node_secret="bench-secret-0123456789abcdef").kv_key()
MODES = {"raw socket": None, "bridge, open": (None, False), "bridge, signed (per-frame MAC)": (KEY, True)}
TARGET = 0.9  # at line rate, the bridge should move KV about as fast as a raw socket on the same link
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_argv(n: int, host: str) -> list[str]:
    """The prefill end's command: this module run with -m from the repository root (run as a script path, it could
    not import its siblings in bench/: issue 52)."""
    return [sys.executable, "-m", "bench.bench_link", "--child", str(n), host]


class Link:
    """A network namespace holding the prefill end, joined to this one by a veth pair shaped on its sending side."""

    def __init__(self, rate: str, mtu: int):
        tag = os.getpid() % 100000
        self.ns, self.here, self.there = f"disagg-link-{tag}", f"dlh{tag}", f"dln{tag}"
        octet = 1 + tag % 250
        self.host, peer = f"10.199.{octet}.1", f"10.199.{octet}.2"
        steps = [["ip", "netns", "add", self.ns],
                 ["ip", "link", "add", self.here, "mtu", str(mtu), "type", "veth", "peer", "name", self.there,
                  "mtu", str(mtu), "netns", self.ns],
                 ["ip", "addr", "add", f"{self.host}/24", "dev", self.here],
                 ["ip", "link", "set", self.here, "up"],
                 self.in_ns("ip", "addr", "add", f"{peer}/24", "dev", self.there),
                 self.in_ns("ip", "link", "set", self.there, "up"),
                 self.in_ns("ip", "link", "set", "lo", "up"),
                 self.in_ns("tc", "qdisc", "add", "dev", self.there, "root", "tbf", "rate", rate, "burst", "2mb",
                            "latency", "5ms")]
        try:
            for cmd in steps:
                subprocess.run(cmd, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            self.close()
            raise SystemExit(f"cannot set up the emulated link: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}")

    def in_ns(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *cmd]

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)  # takes its end of the veth pair along


def child(n: int, host: str) -> None:
    """The prefill end: one command per line on stdin (mode, transfer id, port); answers `ok` once it is sent."""
    layers = kv_layers(n)
    per_layer = layers[0][0].nbytes * 2
    payload = memoryview(np.concatenate([np.concatenate([k.ravel(), v.ravel()]) for k, v in layers]).tobytes())
    senders = {mode: KVSender(key=ends[0], frame_mac=ends[1]) for mode, ends in MODES.items() if ends}
    print("ready", flush=True)
    for line in sys.stdin:
        mode, tid, port = line.rstrip("\n").rsplit(" ", 2)
        if mode in senders:
            s = senders[mode]
            s.open(wire.StreamHeader(transfer_id=tid, fingerprint=SPEC["fingerprint"], num_layers=L, num_kv_heads=H,
                                     head_dim=D, dtype="float32", start=0, num_tokens=n), host, int(port))
            for i, (k, v) in enumerate(layers):
                s.send_layer(tid, i, 0, k, v)
            s.close(tid)
            s.flush()
        else:
            with raw_send(host, int(port), payload, per_layer) as c:
                c.recv(1)  # the receiver closes once it holds every byte
        print("ok", flush=True)


class DecodeEnd:
    """This process: a receiver per bridge mode (long-lived, as on a decode node) and the raw baseline's thread."""

    def __init__(self, link: Link, n: int):
        self.n, self.host, self.lt = n, link.host, LoopThread()
        self.nbytes = L * 2 * H * n * D * 4
        self.rx = {}
        for mode, ends in MODES.items():
            if ends:
                rx, port = KVReceiver(KVConfig(), ends[0], ends[1]), free_port()
                self.lt.call(rx.start(self.host, port))
                self.rx[mode] = (rx, port)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(link.in_ns(*child_argv(n, self.host)), cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answered("ready")

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise SystemExit(f"the prefill end died (exit status {self.proc.returncode}; see its output above)")

    def _ask(self, mode: str, tid: str, port: int) -> None:
        try:
            self.proc.stdin.write(f"{mode} {tid} {port}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._alive()
            raise

    def _answered(self, word: str = "ok") -> None:
        if self.proc.stdout.readline().strip() != word:
            self.proc.wait(5)
            raise SystemExit(f"the prefill end died (exit status {self.proc.returncode}; see its output above)")

    def _wait(self, done, what: str) -> None:
        """Wait up to 120 s for done(0.5) to say yes, failing at once if the prefill end dies meanwhile."""
        for _ in range(240):
            if done(0.5):
                return
            self._alive()
        raise SystemExit(f"{what}: nothing after 120 s")

    def once(self, mode: str, tid: str) -> float:
        """Seconds from the request to the prefill end until this end holds every byte."""
        if mode not in self.rx:
            return self._raw(tid)
        rx, port = self.rx[mode]

        async def expect():
            return rx.expect(tid, self.n, SPEC)
        t = self.lt.call(expect())
        t0 = time.perf_counter()
        self._ask(mode, tid, port)
        fut = asyncio.run_coroutine_threadsafe(t.result(120), self.lt.loop)
        self._wait(lambda s: concurrent.futures.wait([fut], s).done, f"{mode}: the receiver")
        got = fut.result()
        dt = time.perf_counter() - t0
        self._answered()
        if got.nbytes != self.nbytes:
            raise SystemExit(f"receiver counted {got.nbytes} bytes, sent {self.nbytes}")
        self.lt.loop.call_soon_threadsafe(rx.forget, tid)
        got.release()
        return dt

    def _raw(self, tid: str) -> float:
        rx = RawReceiver(self.host, self.nbytes)
        t0 = time.perf_counter()
        self._ask("raw", tid, rx.port)
        self._wait(rx.done.wait, "raw socket: the receiver")
        dt = time.perf_counter() - t0
        self._answered()
        rx.close()
        return dt

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
        for rx, _ in self.rx.values():
            self.lt.call(rx.stop())
        self.lt.close()


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        return child(int(sys.argv[2]), sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="10gbit", help="the link's rate, as tc writes it (10gbit: the site's 10GbE)")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--sizes", default="1024,4096,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="the suite's smoke run: 1024 tokens, one rep (same path)")
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.reps = "1024", 1
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        raise SystemExit("bench_link.py needs root and iproute2 (`ip`, `tc`): it creates a network namespace and a "
                         "shaped veth pair (removed on exit)")
    link = Link(args.rate, args.mtu)
    try:
        print(f"link: veth, mtu {args.mtu}, shaped to {args.rate} (tc tbf) from the prefill end's namespace; "
              f"nproc {len(os.sched_getaffinity(0))}; {L} layers x (K, V) of ({H}, T, {D}) float32, one frame per "
              f"layer; {args.reps} reps in rotating order, medians", flush=True)
        print(f"{'tokens':>7}{'MB':>7}  {'mode':<32}{'ms':>8}{'GB/s':>7}{'/ raw':>8}  target")
        for n in [int(s) for s in args.sizes.split(",")]:
            end = DecodeEnd(link, n)
            try:
                for mode in MODES:  # warm-up: connections, pooled buffers, the link's queue
                    end.once(mode, f"warm-{mode[:3]}-{n}")
                times = {mode: [] for mode in MODES}
                for i in range(args.reps):
                    order = list(MODES)[i % len(MODES):] + list(MODES)[:i % len(MODES)]
                    for j, mode in enumerate(order):
                        times[mode].append(end.once(mode, f"t-{n}-{i}-{j}"))
            finally:
                end.close()
            raw = statistics.median(times["raw socket"])
            for mode, ts in times.items():
                m = statistics.median(ts)
                verdict = "" if mode == "raw socket" else f">= {TARGET}x {'ok' if raw / m >= TARGET else 'MISS'}"
                print(f"{n:>7}{end.nbytes / 1e6:>7.1f}  {mode:<32}{m * 1e3:>8.1f}{end.nbytes / m / 1e9:>7.2f}"
                      f"{raw / m:>7.2f}x  {verdict}", flush=True)
    finally:
        link.close()


if __name__ == "__main__":
    main()
