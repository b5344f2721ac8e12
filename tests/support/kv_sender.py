"""A decode node that stops reading (StalledReceiver) and a sender's frames of random KV: what test_kv_sender,
test_kv_sender_budget and bench/bench_stall.py send into."""

from __future__ import annotations

import socket
import threading

import numpy as np

from kv_bridge import wire
from kv_bridge.sender import KVSender

L, H, D = 4, 2, 64
SPEC = {"fingerprint": "abc123", "num_layers": L, "num_kv_heads": H, "head_dim": D}


def header(tid: str, n: int) -> wire.StreamHeader:
    return wire.StreamHeader(tid, "abc123", L, H, D, "float32", 0, n)


class StalledReceiver:
    """Accepts, answers the stream header with ACK, then never reads again (a hung decode node)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            c.recv(4096)  # the HEADER frame (small)
            c.sendall(wire.json_frame(wire.ACK, {}))

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()


def frames(sender: KVSender, tid: str, n: int, chunk: int, seed: int):
    rng = np.random.default_rng(seed)
    k, v = rng.standard_normal((L, H, n, D), np.float32), rng.standard_normal((L, H, n, D), np.float32)
    for a in range(0, n, chunk):
        for layer in range(L):
            sender.send_layer(tid, layer, a, np.ascontiguousarray(k[layer, :, a:a + chunk]),
                              np.ascontiguousarray(v[layer, :, a:a + chunk]))
    sender.close(tid)
    return k, v
