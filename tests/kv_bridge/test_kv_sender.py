"""The sender under a decode node that stops reading: its own transfer fails at the send timeout (with room in the
byte budget; a full budget is tests/kv_bridge/test_kv_sender_budget.py), a concurrent
transfer to a healthy receiver completes meanwhile, and queued host memory never passes the byte bound.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver
from kv_bridge.sender import KVSender
from tests.support.kv_sender import SPEC, StalledReceiver, frames, header
from tests.support.stack import free_port


def test_stalled_destination_fails_alone_at_the_send_timeout():
    """The byte budget has room for all of it (test_kv_sender_budget.py covers a full one): only the send timeout
    can fail the stalled transfer."""
    bound = 64 << 20  # queued KV per destination: both the stalled transfer (32 MiB) and the healthy one fit
    sender = KVSender(max_bytes=bound, send_timeout_s=1.0)
    stalled = StalledReceiver()

    async def go():
        rx = KVReceiver(KVConfig())
        port = free_port()
        await rx.start("127.0.0.1", port)
        healthy = rx.expect("healthy", 2048, SPEC)
        try:
            sender.open(header("stuck", 8192), "127.0.0.1", stalled.port)
            sender.open(header("healthy", 2048), "127.0.0.1", port)
            # the forward pass: the stalled transfer's frames first, the healthy one's after them
            stuck = asyncio.to_thread(frames, sender, "stuck", 8192, 256, 1)
            await stuck
            want = await asyncio.to_thread(frames, sender, "healthy", 2048, 256, 2)
            got = await healthy.result(30)
            flushed = threading.Thread(target=sender.flush, daemon=True)  # a hang here fails, not hangs, the test
            flushed.start()
            await asyncio.to_thread(flushed.join, 60)
            assert not flushed.is_alive(), "the stalled transfer never failed: no send timeout"
            return want, got
        finally:
            await rx.stop()
    try:
        (k, v), got = asyncio.run(go())
    finally:
        stalled.close()  # first: a sender blocked on it errors out, so shutdown does not wait
        sender.shutdown()
    assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)
    assert sender.stats.failed == ["stuck"] and "healthy" in sender.stats.finished
    assert sender.stats.peak_queued_bytes <= bound
    assert sender.queued_bytes == 0  # the stalled transfer's frames were dropped, their memory freed
