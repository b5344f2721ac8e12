"""KV bridge unit tests over real loopback sockets: sender -> receiver, integrity, bounds, fuzzed frames."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import socket
import struct
import threading
import time
import zlib

import blake3
import numpy as np
import pytest
import xxhash

from kv_bridge import wire
from kv_bridge.config.nodes import KVConfig
from kv_bridge.vllm.layouts import layout_for
from kv_bridge.receiver import KVReceiver, TransferError, _Connection
from kv_bridge.sender import KVSender, sendall_parts
from tests.support.kv_wire import D, H, L, SPEC, header, kv_data, kv_frame, raw_send, send_with_sender
from tests.support.stack import free_port


async def run_transfer(send, n: int = 10, cfg: KVConfig | None = None, spec: dict = SPEC, rx_cls=KVReceiver):
    """Start a receiver, expect one transfer, let `send(port, tid)` (run in a thread) deliver it."""
    rx = rx_cls(cfg or KVConfig())
    port = free_port()
    await rx.start("127.0.0.1", port)
    try:
        t = rx.expect("t1", n, spec)
        await asyncio.to_thread(send, port, "t1")
        return await t.result(10)
    finally:
        await rx.stop()


def test_sender_to_receiver_roundtrip_in_chunks():
    k, v = kv_data(300)
    got = asyncio.run(run_transfer(send_with_sender(k, v, chunks=(0, 128, 256)), n=300))
    assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)
    assert got.nbytes == k.nbytes + v.nbytes


class _TakenReceiver(KVReceiver):
    """A receiver that tells the sending thread how many bytes its connection has taken off the socket."""

    taken = 0
    cond = threading.Condition()

    class connection_cls(_Connection):
        def took(self, nbytes: int) -> None:
            with _TakenReceiver.cond:
                _TakenReceiver.taken += nbytes
                _TakenReceiver.cond.notify_all()


def test_link_time_counts_bytes_on_the_way_not_the_gaps_between_frames():
    """The learned link rate's clock: a frame whose second half comes 0.3 s after the receiver took its first half
    counts those 0.3 s; the 0.4 s pauses between frames (the prefill computing the next layer) do not. The sender
    waits until the receiver has taken what was sent before each pause, so a late loop cannot shorten one."""
    k, v = kv_data(10)
    _TakenReceiver.taken = 0

    def send(port, tid):
        sent = 0

        def put(s, data: bytes) -> None:  # send, then wait until the receiver has read it all
            nonlocal sent
            s.sendall(data)
            sent += len(data)
            with _TakenReceiver.cond:
                assert _TakenReceiver.cond.wait_for(lambda: _TakenReceiver.taken >= sent, timeout=10)

        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            put(s, hdr_frame(tid, 10))
            s.recv(wire.PREFIX.size + 2 + wire.CRC.size, socket.MSG_WAITALL)  # ACK ({})
            for layer in range(L):
                frame = kv_frame(layer, 0, k[layer], v[layer])
                if layer == 0:
                    put(s, frame[:len(frame) // 2])
                    time.sleep(0.3)
                    put(s, frame[len(frame) // 2:])
                else:
                    time.sleep(0.4)
                    put(s, frame)
            s.sendall(wire.json_frame(wire.DONE, {}))
            s.shutdown(socket.SHUT_WR)
            while s.recv(1 << 16):
                pass

    got = asyncio.run(run_transfer(send, rx_cls=_TakenReceiver))
    assert np.array_equal(got.keys, k)
    assert got.link_s >= 0.3  # the half-frame wait, all of it
    assert got.seconds - got.link_s >= 3 * 0.4  # the pauses between frames are not link time


def test_fingerprint_mismatch_names_both_sides():
    k, v = kv_data(10)
    with pytest.raises(TransferError) as e:
        asyncio.run(run_transfer(send_with_sender(k, v, fingerprint="other"), n=10))
    assert "abc123" in str(e.value) and "other" in str(e.value)


def test_wrong_token_count_refused():
    k, v = kv_data(10)
    with pytest.raises(TransferError, match="decode expects"):
        asyncio.run(run_transfer(send_with_sender(k, v), n=11))


def hdr_frame(tid="t1", n=10) -> bytes:
    return wire.json_frame(wire.HEADER, header(tid, n).to_json())


def test_truncated_stream_fails_the_transfer():
    k, v = kv_data(10)
    frame = kv_frame(0, 0, k[0], v[0])
    with pytest.raises(TransferError, match="mid-frame"):
        asyncio.run(run_transfer(raw_send([hdr_frame(), frame[: len(frame) // 2]])))


def test_other_wire_version_is_refused_by_name_at_once():
    """A node of wire version 1 (crc32 KV frames) reads the same HEADER/ERROR frames: both sides learn why."""
    old = wire.json_frame(wire.HEADER, {**header("t1", 10).to_json(), "version": 1})
    with pytest.raises(TransferError, match=f"wire version 1 not supported .this side speaks {wire.VERSION}"):
        asyncio.run(run_transfer(raw_send([old])))


def test_kv_frames_carry_xxh3_json_frames_crc32():
    k, v = kv_data(3)
    kv = kv_frame(0, 0, k[0], v[0])
    body = kv[wire.PREFIX.size:-wire.XXH.size]
    assert wire.XXH.unpack(kv[-wire.XXH.size:])[0] == xxhash.xxh3_64_intdigest(body)
    ack = wire.json_frame(wire.ACK, {})
    assert wire.CRC.unpack(ack[-wire.CRC.size:])[0] == zlib.crc32(ack[wire.PREFIX.size:-wire.CRC.size])


@pytest.mark.parametrize("secret", [False, True])
def test_frame_batches_hash_piece_by_piece_to_the_whole_frames_trailer(secret):
    """The sender hashes a payload HOT_BYTES at a time, each piece just before it is sent: the trailer must still be
    the whole body's xxh3_64 (open) or keyed-BLAKE3 tag (checked with the xxhash and blake3 packages)."""
    k, v = kv_data(700)  # 1.1 MB a frame: several pieces, the last one short
    body = wire.kv_body(2, 0, k[2], v[2])
    mac = wire.FrameMac(b"k" * 32, "ab" * 32) if secret else None
    batches = [b"".join(bytes(p) for p in batch) for batch in wire.frame_batches(wire.KV, body, mac)]
    assert len(batches) > 4 and all(len(b) <= wire.HOT_BYTES + wire.PREFIX.size for b in batches[:-1])
    frame, want_body = b"".join(batches), b"".join(bytes(p) for p in body)
    assert frame[:wire.PREFIX.size] == wire.PREFIX.pack(wire.KV, len(want_body))
    assert frame[wire.PREFIX.size:wire.PREFIX.size + len(want_body)] == want_body
    trailer = frame[wire.PREFIX.size + len(want_body):]
    if secret:
        key = blake3.blake3(b"k" * 32, derive_key_context=wire.FRAME_KEY_CONTEXT).digest()
        assert trailer == blake3.blake3(bytes.fromhex("ab" * 32) + frame[:-32], key=key).digest()
    else:
        assert trailer == wire.XXH.pack(xxhash.xxh3_64_intdigest(want_body))


@pytest.mark.parametrize("secret", [False, True])
def test_frames_larger_than_a_hashed_piece_arrive_whole(secret):
    """KVSender -> KVReceiver with 1.1 MB frames, open (checksum) and with frame MACs (tag only)."""
    k, v = kv_data(700)
    key = b"s" * 32 if secret else None

    def send(port, tid):
        s = KVSender(max_bytes=64 << 20, key=key)
        s.open(header(tid, 700), "127.0.0.1", port)
        for layer in range(L):
            s.send_layer(tid, layer, 0, k[layer], v[layer])
        s.close(tid)
        s.flush()
        s.shutdown()
        assert s.stats.finished == [tid]
    got = asyncio.run(run_transfer(send, n=700, rx_cls=functools.partial(KVReceiver, key=key)))
    assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)


def test_sendall_parts_survives_partial_writes():
    """sendmsg writes what the socket buffer takes; the rest must follow, in order, from the right offset."""
    rng = np.random.default_rng(5)
    parts = [b"ab", rng.integers(0, 255, 3 << 20, np.uint8), memoryview(b"c"), rng.standard_normal(1 << 19)]
    want = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # forces many partial sendmsg calls
    got = bytearray()
    reader = threading.Thread(target=lambda: [got.extend(c) for c in iter(lambda: b.recv(1 << 16), b"")])
    reader.start()
    with a:
        assert sendall_parts(a, parts) == len(want)
    reader.join(10)
    b.close()
    assert bytes(got) == want


def test_corrupt_checksum_fails_the_transfer():
    k, v = kv_data(10)
    frame = bytearray(kv_frame(0, 0, k[0], v[0]))
    frame[100] ^= 0xFF
    with pytest.raises(TransferError, match="checksum"):
        asyncio.run(run_transfer(raw_send([hdr_frame(), bytes(frame)])))


OPEN_ATTACKS = {
    "flip a payload byte": lambda f: f[:-9] + bytes([f[-9] ^ 1]) + f[-8:],
    "flip a checksum byte": lambda f: f[:-1] + bytes([f[-1] ^ 1]),
    "truncate the checksum, then close": lambda f: f[:-3],
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("attack", list(OPEN_ATTACKS))
def test_open_stream_refuses_altered_or_truncated_frames(attack, dtype):
    """No secret: the xxh3 checksum guards each frame, on the in-place (float32) and buffered (float16) paths."""
    k, v = (a.astype(dtype) for a in kv_data(10))
    head = wire.json_frame(wire.HEADER, header("t1", 10, dtype=dtype).to_json())
    frames = [kv_frame(layer, 0, k[layer], v[layer]) for layer in range(L)]
    frames[1] = OPEN_ATTACKS[attack](frames[1])
    if "close" in attack:
        frames = frames[:2]
    with pytest.raises(TransferError) as e:
        asyncio.run(run_transfer(raw_send([head, *frames, wire.json_frame(wire.DONE, {})])))
    assert e.value.reason == "kv_error"


def test_done_before_all_kv_is_refused():
    k, v = kv_data(10)
    frames = [hdr_frame(), kv_frame(0, 0, k[0], v[0]), wire.json_frame(wire.DONE, {})]
    with pytest.raises(TransferError, match="missing"):
        asyncio.run(run_transfer(raw_send(frames)))


def test_huge_declared_length_rejected_before_allocation():
    huge = struct.pack("<BI", wire.KV, 0xFFFFFFF0)
    with pytest.raises(TransferError, match="over the bound"):
        asyncio.run(run_transfer(raw_send([hdr_frame(), huge]), cfg=KVConfig(max_frame_bytes=1 << 20)))


def test_fuzzed_frames_never_crash_the_receiver():
    """Random mutations of a valid stream: every one fails cleanly, and the receiver keeps serving."""
    rng = random.Random(1234)
    k, v = kv_data(10)
    body = [*(kv_frame(i, 0, k[i], v[i]) for i in range(L)), wire.json_frame(wire.DONE, {})]

    async def scenario():
        rx = KVReceiver(KVConfig(max_frame_bytes=1 << 16))
        port = free_port()
        await rx.start("127.0.0.1", port)
        outcomes = []
        try:
            for i in range(60):
                tid = f"f{i}"
                t = rx.expect(tid, 10, SPEC)
                stream = bytearray(b"".join([hdr_frame(tid), *body]))
                for _ in range(rng.randint(1, 4)):  # flip, truncate or splice random bytes
                    # half the mutations hit the header and the first frame prefixes, where parsing decides most
                    pos = rng.randrange(min(len(stream), 256) if rng.random() < 0.5 else len(stream))
                    op = rng.choice(("flip", "cut", "junk"))
                    if op == "flip":
                        stream[pos] ^= 1 << rng.randrange(8)
                    elif op == "cut":
                        del stream[pos:]
                    else:
                        stream[pos:pos] = rng.randbytes(rng.randint(1, 64))
                    if not stream:
                        break
                await asyncio.to_thread(raw_send([bytes(stream)]), port, tid)
                try:
                    # The send returned once the receiver closed the connection (send_then_drain): whatever it
                    # decided for this transfer is decided. One whose header was too mangled to name it stays
                    # pending, and only its wait's timeout ends it.
                    await t.result(0.05)
                    outcomes.append("ok")
                except TransferError as e:
                    outcomes.append(e.reason)
                rx.forget(tid)
            # still healthy: a clean transfer after the fuzzing goes through
            t = rx.expect("clean", 10, SPEC)
            await asyncio.to_thread(send_with_sender(k, v), port, "clean")
            got = await t.result(5)
        finally:
            await rx.stop()
        return outcomes, got

    outcomes, got = asyncio.run(scenario())
    assert set(outcomes) <= {"ok", "kv_error", "kv_timeout"}
    assert outcomes.count("kv_error") >= 10 and outcomes.count("ok") <= 5
    assert np.array_equal(got.keys, k)


def test_parse_kv_rejects_out_of_range_frames():
    hdr = header("t", 10)
    k, v = kv_data(10)
    for layer, start in ((L, 0), (0, 8)):
        body = memoryview(kv_frame(layer, start, k[0], v[0])[wire.PREFIX.size:-wire.XXH.size])
        with pytest.raises(wire.WireError):
            wire.parse_kv(body, hdr)


def test_drafter_layers_are_declared_bounded_and_signed():
    """A drafter's layer (StreamHeader.draft_layers) follows the model's: a frame for it parses, one past it does
    not; the header's tag covers the count; an absurd count is refused before anything is allocated."""
    hdr = header("t", 10, draft_layers=1)
    assert wire.StreamHeader.from_json(hdr.to_json()) == hdr and hdr.stream_layers == tuple(range(L + 1))
    assert "draft_layers" not in header("t", 10).to_json()  # a stream without a drafter: its JSON as before
    k, v = kv_data(10)
    for layer, ok in ((L, True), (L + 1, False)):
        body = memoryview(kv_frame(layer, 0, k[0], v[0])[wire.PREFIX.size:-wire.XXH.size])
        if ok:
            assert wire.parse_kv(body, hdr)[0] == L
        else:
            with pytest.raises(wire.WireError, match="does not carry"):
                wire.parse_kv(body, hdr)
    key = b"k" * 32
    signed = wire.sign_header(hdr, key)
    assert wire.header_auth_ok(signed, key)
    assert not wire.header_auth_ok(wire.StreamHeader.from_json({**signed.to_json(), "draft_layers": 0}), key)
    with pytest.raises(wire.WireError, match="draft_layers"):
        wire.StreamHeader.from_json({**hdr.to_json(), "draft_layers": wire.MAX_DRAFT_LAYERS + 1})


def test_bad_json_header_fields_rejected():
    for bad in ({}, {**header("t", 1).to_json(), "version": 99}, {**header("t", 1).to_json(), "dtype": "int8"},
                {**header("t", 1).to_json(), "num_tokens": -1}):
        with pytest.raises(wire.WireError):
            wire.StreamHeader.from_json(bad)
    with pytest.raises(wire.WireError):
        wire.parse_json(b"\xff\xfe")
    assert zlib.crc32(b"") == 0 and json.loads(b"{}") == {}


@pytest.mark.parametrize("start,end", [(0, 1), (0, 128), (5, 130), (127, 129), (100, 400)])
def test_cpu_layout_gather_inverts_scatter(start, end):
    lay = layout_for("CPU_ATTN", block_size=128, num_kv_heads=H, head_dim=D, isa="vec", cache_dtype="float32")
    blocks = [7, 2, 5, 0]
    paged = np.zeros((8, H, 128, 2 * D), np.float32)
    k, v = kv_data(512)
    lay.scatter(paged, blocks, 0, k[0], v[0])
    gk, gv = lay.gather(paged, blocks, start, end)
    assert np.array_equal(gk, k[0][:, start:end]) and np.array_equal(gv, v[0][:, start:end])


def test_unknown_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="FLASH_ATTN_9000"):
        layout_for("FLASH_ATTN_9000", 16, 8, 128)


def test_released_receive_buffers_serve_the_next_transfer_and_failed_ones_are_not_reused():
    async def scenario():
        rx = KVReceiver(KVConfig())
        port = free_port()
        await rx.start("127.0.0.1", port)
        try:
            got = []
            for i, n in enumerate((40, 40, 30)):
                k, v = kv_data(n, seed=i)
                t = rx.expect(f"p{i}", n, SPEC)
                await asyncio.to_thread(send_with_sender(k, v), port, f"p{i}")
                kv = await t.result(10)
                assert np.array_equal(kv.keys, k) and np.array_equal(kv.values, v)
                got.append(kv.keys.base)
                rx.forget(f"p{i}")
                kv.release()
                assert kv.keys is None
            # the second transfer landed in the first one's buffers; 30 tokens fit in 40 tokens' buffers too
            assert got[1] is got[0] and got[2] is got[0]
            idle = rx.pool.idle_bytes
            k, v = kv_data(40, seed=9)
            t = rx.expect("bad", 40, SPEC)
            frame = kv_frame(0, 0, k[0], v[0])
            await asyncio.to_thread(raw_send([hdr_frame("bad", 40), frame[: len(frame) // 2]]), port, "bad")
            with pytest.raises(TransferError):
                await t.result(10)
            rx.forget("bad")
            assert rx.pool.idle_bytes == idle - 2 * L * H * 40 * D * 4  # taken by the failed transfer, never given back
        finally:
            await rx.stop()

    asyncio.run(scenario())


def _receiver_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "disagg-kv-recv" and t.is_alive()]


class _Recording(KVReceiver):
    """A receiver that keeps every connection it made (to check each one's socket after it ended)."""

    class connection_cls(_Connection):
        made: list = []

        def __init__(self, rx, sock):
            super().__init__(rx, sock)
            self.made.append(self)


def test_connection_threads_end_after_a_cut_and_at_stop():
    """Each connection is read on a thread of its own: a stream cut mid-frame ends its thread (and its transfer);
    stop() drops a connection still waiting to send its HEADER and one stalled mid-frame, and waits for both
    threads, whose sockets the peers then see closed."""
    k, v = kv_data(10)
    frame = kv_frame(0, 0, k[0], v[0])

    async def scenario():
        rx = _Recording(KVConfig())
        port = free_port()
        await rx.start("127.0.0.1", port)
        t = rx.expect("cut", 10, SPEC)
        await asyncio.to_thread(raw_send([hdr_frame("cut"), frame[:len(frame) // 2]]), port, "cut")
        with pytest.raises(TransferError, match="mid-frame"):
            await t.result(10)
        for _ in range(100):
            if not _receiver_threads():
                break
            await asyncio.sleep(0.02)
        assert not _receiver_threads() and not rx._conns  # the cut connection's thread ended
        rx.expect("stalled", 10, SPEC)
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)  # never sends a HEADER

        def stall() -> socket.socket:
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(hdr_frame("stalled"))
            s.recv(wire.PREFIX.size + 2 + wire.CRC.size, socket.MSG_WAITALL)  # ACK
            s.sendall(frame[:len(frame) // 2])  # and no more
            return s
        stalled = await asyncio.to_thread(stall)
        while len(_receiver_threads()) < 2:
            await asyncio.sleep(0.01)
        await rx.stop()
        alive = _receiver_threads()
        closed = [await asyncio.to_thread(s.recv, 1) == b"" for s in (idle, stalled)]
        idle.close()
        stalled.close()
        return alive, closed, [c.sock.fileno() for c in rx.connection_cls.made]

    alive, closed, fds = asyncio.run(scenario())
    assert alive == [] and closed == [True, True]
    assert fds == [-1, -1, -1]  # the cut, the idle and the stalled connection: each socket closed by its thread


def test_connections_past_the_bound_are_closed_at_accept():
    """Each connection costs a thread: past `max_connections` open ones, another is closed before any starts, and
    once one ends a new connection is served again."""
    async def scenario():
        rx = KVReceiver(KVConfig())
        rx.max_connections = 2
        port = free_port()
        await rx.start("127.0.0.1", port)
        try:
            idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]  # no HEADER yet
            while len(_receiver_threads()) < 2:
                await asyncio.sleep(0.01)
            extra = socket.create_connection(("127.0.0.1", port), timeout=10)
            refused = await asyncio.to_thread(extra.recv, 1) == b""
            threads = len(_receiver_threads())
            idle.pop().close()  # one ends: its thread sees EOF and goes
            while len(rx._conns) > 1:
                await asyncio.sleep(0.01)
            k, v = kv_data(10)
            t = rx.expect("after", 10, SPEC)
            await asyncio.to_thread(send_with_sender(k, v), port, "after")
            got = await t.result(10)
            for s in (*idle, extra):
                s.close()
            return refused, threads, got
        finally:
            await rx.stop()

    refused, threads, got = asyncio.run(scenario())
    assert refused and threads == 2
    assert np.array_equal(got.keys, kv_data(10)[0])
