"""The sender's byte budget is per destination and never blocks the forward thread: a decode node that stops
reading fails its own transfer as soon as its queue is full (long before any send timeout), while a transfer to
a healthy decode node, queued after it on the same forward thread, completes byte for byte.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver, TransferError
from kv_bridge.sender import KVSender
from tests.support.stack import free_port
from tests.support.kv_sender import D, H, L, SPEC, StalledReceiver, frames, header

HANG_S = 3600.0  # a send timeout no test waits out: only the budget can fail the stalled transfer
GUARD_S = 60.0  # how long the test waits for a forward thread that should never block at all


def forward(sender: KVSender, tid: str, n: int, seed: int, out: dict) -> threading.Thread:
    """The forward pass producing one transfer's frames, on its own thread (so a block there cannot hang pytest)."""
    t = threading.Thread(target=lambda: out.__setitem__(tid, frames(sender, tid, n, 256, seed)), daemon=True)
    t.start()
    return t


def test_full_destination_fails_its_transfer_without_blocking_the_forward_thread():
    bound = 12 << 20  # per destination: the healthy transfer (8 MiB) always fits, the stalled one (32 MiB) not
    sender = KVSender(max_bytes=bound, send_timeout_s=HANG_S)
    stalled = StalledReceiver()

    async def go():
        rx = KVReceiver(KVConfig())
        port = free_port()
        await rx.start("127.0.0.1", port)
        healthy = rx.expect("healthy", 2048, SPEC)
        out: dict = {}
        try:
            sender.open(header("stuck", 8192), "127.0.0.1", stalled.port)
            sender.open(header("healthy", 2048), "127.0.0.1", port)
            stuck = forward(sender, "stuck", 8192, 1, out)
            await asyncio.to_thread(stuck.join, GUARD_S)
            assert not stuck.is_alive(), "the forward thread waited on the stalled destination's budget"
            ok = forward(sender, "healthy", 2048, 2, out)
            await asyncio.to_thread(ok.join, GUARD_S)
            return out["healthy"], await healthy.result(30)
        finally:
            await rx.stop()
    try:
        (k, v), got = asyncio.run(go())
        assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)
        assert "stuck" in sender.stats.failed and "healthy" in sender.stats.finished
        assert sender.stats.peak_queued_bytes <= bound
    finally:
        stalled.close()  # the stalled writer's socket errors out, so shutdown does not wait HANG_S
        sender.shutdown()


def test_overflowed_transfer_ends_with_an_error_at_a_reading_receiver():
    """A destination whose queue is full (here: its first frame's device copy not done yet) gets ERROR for that
    transfer, so its decode node prefills locally; never a DONE over missing frames."""
    sender = KVSender(max_bytes=1 << 20, send_timeout_s=HANG_S)
    copied = threading.Event()
    k = np.ones((H, 1024, D), np.float32)  # K + V: 1 MiB a frame, the whole bound

    async def go():
        rx = KVReceiver(KVConfig())
        port = free_port()
        await rx.start("127.0.0.1", port)
        t = rx.expect("big", 2048, SPEC)
        try:
            sender.open(header("big", 2048), "127.0.0.1", port)
            for a in (0, 1024):
                for layer in range(L):
                    sender.send_layer("big", layer, a, k, k, ready=lambda: copied.wait(GUARD_S))
            copied.set()
            sender.close("big")
            try:
                await t.result(30)
            except TransferError as e:
                return str(e)
            return "completed"
        finally:
            await rx.stop()
    try:
        err = asyncio.run(go())
    finally:
        sender.shutdown()
    assert "sender_bytes" in err, err
    assert sender.stats.failed == ["big"] and sender.queued_bytes == 0
