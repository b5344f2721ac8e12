"""Signed KV transfers over real sockets (test_auth_kv, test_kv_frame_mac): a node secret's KV key, a small spec and
its header, and a receiver holding that key that expects one transfer."""

from __future__ import annotations

import asyncio

from kv_bridge import wire
from kv_bridge.config.auth import AuthConfig
from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver
from tests.support.stack import free_port

L, H, D = 4, 3, 64
SPEC = {"fingerprint": "abc123", "num_layers": L, "num_kv_heads": H, "head_dim": D}
KEY = AuthConfig(node_secret="kv-secret-for-tests-0123456789").kv_key()


def header(tid: str = "t1", n: int = 10, **over) -> wire.StreamHeader:
    fields = dict(transfer_id=tid, fingerprint="abc123", num_layers=L, num_kv_heads=H, head_dim=D,
                  dtype="float32", start=0, num_tokens=n)
    return wire.StreamHeader(**{**fields, **over})


async def receive(send, n: int = 10, key: bytes | None = KEY, frame_mac: bool = True) -> wire.StreamHeader:
    """A receiver (with `key`) expecting transfer t1; `send(port)` runs in a thread; returns the transfer's result."""
    rx = KVReceiver(KVConfig(), key, frame_mac)
    port = free_port()
    await rx.start("127.0.0.1", port)
    try:
        t = rx.expect("t1", n, SPEC)
        await asyncio.to_thread(send, port)
        return await t.result(10)
    finally:
        await rx.stop()
