"""Synthetic KV transfers over the wire (test_kv_wire, test_kv_prefix_wire): a small spec, its stream header, random
KV, a real KVSender that sends it in chunks, and raw frames sent as bytes."""

from __future__ import annotations

import numpy as np

from kv_bridge import wire
from kv_bridge.sender import KVSender
from tests.support.stack import send_then_drain

L, H, D = 4, 3, 64
SPEC = {"fingerprint": "abc123", "num_layers": L, "num_kv_heads": H, "head_dim": D}


def header(tid: str, n: int, **over) -> wire.StreamHeader:
    fields = dict(transfer_id=tid, fingerprint="abc123", num_layers=L, num_kv_heads=H, head_dim=D,
                  dtype="float32", start=0, num_tokens=n)
    fields.update(over)
    return wire.StreamHeader(**fields)


def kv_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, H, n, D), np.float32), rng.standard_normal((L, H, n, D), np.float32)


def send_with_sender(keys, values, chunks=(0,), **hdr_over):
    def send(port, tid):
        s = KVSender(max_bytes=64 << 20)  # the whole transfer fits: a fuller destination fails its transfer
        n = keys.shape[2]
        s.open(header(tid, n, **hdr_over), "127.0.0.1", port)
        bounds = list(chunks) + [n]
        for a, b in zip(bounds, bounds[1:]):  # chunked prefill: several frames per layer
            for layer in range(L):
                s.send_layer(tid, layer, a, np.ascontiguousarray(keys[layer, :, a:b]),
                             np.ascontiguousarray(values[layer, :, a:b]))
        s.close(tid)
        s.flush()
        s.shutdown()
    return send


def raw_send(frames: list[bytes]):
    def send(port, tid):
        send_then_drain(port, frames)
    return send


def kv_frame(layer, start, k, v) -> bytes:
    return b"".join(bytes(p) for p in wire.kv_frame_parts(layer, start, k, v))
