"""Transfers of tokens [start, total) over real loopback sockets: the decode node holds the first `start` tokens."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kv_bridge import wire
from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver, TransferError
from tests.support.stack import free_port
from tests.support.kv_wire import SPEC, header, kv_data, kv_frame, raw_send, send_with_sender


async def run_from(send, start: int, n: int):
    rx = KVReceiver(KVConfig())
    port = free_port()
    await rx.start("127.0.0.1", port)
    try:
        t = rx.expect("t1", n, SPEC, start=start)
        await asyncio.to_thread(send, port, "t1")
        return await t.result(10)
    finally:
        await rx.stop()


def test_tail_transfer_lands_at_absolute_positions():
    k, v = kv_data(300)
    tail_k, tail_v = k[:, :, 100:], v[:, :, 100:]

    def send(port, tid):  # frames say absolute positions 100.., chunked at 128 and 256 like a chunked prefill
        full = np.zeros_like(k), np.zeros_like(v)
        full[0][:, :, 100:], full[1][:, :, 100:] = tail_k, tail_v
        send_with_sender(*full, chunks=(100, 128, 256), start=100, num_tokens=200)(port, tid)

    got = asyncio.run(run_from(send, 100, 300))
    assert got.start == 100 and got.keys.shape == (4, 3, 200, 64)
    assert np.array_equal(got.keys, tail_k) and np.array_equal(got.values, tail_v)
    assert got.nbytes == tail_k.nbytes + tail_v.nbytes  # 200/300 of a full transfer


def test_header_must_declare_exactly_the_expected_range():
    k, v = kv_data(300)
    with pytest.raises(TransferError, match=r"declares tokens \[0, 300\), decode expects \[100, 300\)"):
        asyncio.run(run_from(send_with_sender(k, v), 100, 300))  # a sender that ignored kv_start
    with pytest.raises(TransferError, match=r"declares tokens \[100, 299\)"):
        asyncio.run(run_from(send_with_sender(k[:, :, :199], v[:, :, :199], start=100, num_tokens=199), 100, 300))


def test_frame_below_start_is_refused():
    k, v = kv_data(10)
    frames = [wire.json_frame(wire.HEADER, header("t1", 6, start=4).to_json()), kv_frame(0, 0, k[0], v[0])]
    with pytest.raises(TransferError, match=r"outside the stream's \[4, 10\)"):
        asyncio.run(run_from(raw_send(frames), 4, 10))


def test_expect_refuses_an_empty_or_negative_range():
    async def expect(start, n):
        KVReceiver(KVConfig()).expect("t", n, SPEC, start=start)

    for start, n in ((10, 10), (-1, 10), (11, 10)):
        with pytest.raises(ValueError, match="0 <= start < num_tokens"):
            asyncio.run(expect(start, n))
