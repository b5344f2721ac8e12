"""KV stream authentication over real loopback sockets: signed headers, chained per-frame MACs, and refusals
that fail the transfer (reason kv_error, so decode prefills locally) before any payload is read."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import numpy as np
import pytest

from kv_bridge import wire
from kv_bridge.config.auth import AuthConfig
from kv_bridge.receiver import TransferError
from kv_bridge.sender import KVSender
from tests.support.kv_auth import D, H, KEY, L, header, receive

OTHER_KEY = AuthConfig(node_secret="not-the-same-secret-012345678").kv_key()


def kv_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, H, n, D), np.float32), rng.standard_normal((L, H, n, D), np.float32)


def with_sender(keys, values, key: bytes | None, frame_mac: bool = True, chunks=(0,)):
    def send(port):
        s = KVSender(max_bytes=64 << 20, key=key, frame_mac=frame_mac)  # the whole transfer fits
        n = keys.shape[2]
        s.open(header("t1", n), "127.0.0.1", port)
        bounds = [*chunks, n]
        for a, b in zip(bounds, bounds[1:]):
            for layer in range(L):
                s.send_layer("t1", layer, a, np.ascontiguousarray(keys[layer, :, a:b]),
                             np.ascontiguousarray(values[layer, :, a:b]))
        s.close("t1")
        s.flush()
        s.shutdown()
        send.stats = s.stats
    return send


@pytest.mark.parametrize("frame_mac", [True, False])
def test_signed_stream_is_accepted(frame_mac):
    k, v = kv_data(300)
    got = asyncio.run(receive(with_sender(k, v, KEY, frame_mac, chunks=(0, 128, 256)), n=300, frame_mac=frame_mac))
    assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)


@pytest.mark.parametrize("sender_key,match", [(None, "carries no authenticator"),
                                              (OTHER_KEY, "authenticator is wrong")])
def test_unsigned_or_wrongly_signed_stream_fails_the_transfer(sender_key, match):
    k, v = kv_data(10)
    send = with_sender(k, v, sender_key)
    with pytest.raises(TransferError, match=match) as e:
        asyncio.run(receive(send))
    assert e.value.reason == "kv_error"  # decode falls back to local prefill at once, not after kv_timeout
    assert send.stats.failed_transfers == 1 and send.stats.finished == []


def test_signed_stream_to_a_receiver_without_a_secret_is_refused():
    k, v = kv_data(10)
    with pytest.raises(TransferError, match="has no node secret"):
        asyncio.run(receive(with_sender(k, v, KEY), key=None))


def test_receiver_that_requires_frame_macs_refuses_header_only_auth():
    k, v = kv_data(10)
    with pytest.raises(TransferError, match="requires per-frame MACs"):
        asyncio.run(receive(with_sender(k, v, KEY, frame_mac=False), frame_mac=True))


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _read_frame(sock: socket.socket) -> tuple[int, dict]:
    prefix = sock.recv(wire.PREFIX.size, socket.MSG_WAITALL)
    ftype, length = wire.PREFIX.unpack(prefix)
    data = sock.recv(length + wire.checksum_size(wire.ACK), socket.MSG_WAITALL)
    return ftype, wire.parse_json(data[:length])


def kv_frame(layer: int, start: int, k, v) -> list[bytes]:
    return [bytes(p) for p in wire.kv_frame_parts(layer, start, k, v)]


@pytest.mark.parametrize("forge", ["no auth", "wrong key", "tampered field", "auth of another transfer"])
def test_forged_header_gets_an_error_frame_before_any_payload(forge):
    good = wire.sign_header(header(), KEY)
    hdr = {"no auth": header(), "wrong key": wire.sign_header(header(), OTHER_KEY),
           "tampered field": dataclasses.replace(good, dtype="float16"),
           "auth of another transfer": dataclasses.replace(wire.sign_header(header("t0"), KEY), transfer_id="t1"),
           }[forge]

    def send(port):
        with _connect(port) as s:
            s.sendall(wire.json_frame(wire.HEADER, hdr.to_json()))
            ftype, body = _read_frame(s)  # the receiver answers the header itself: no payload was read
            assert ftype == wire.ERROR and "authenticator" in body["message"]
            assert s.recv(1) == b""  # and closes the connection

    with pytest.raises(TransferError, match="authenticator") as e:
        asyncio.run(receive(send))
    assert e.value.reason == "kv_error"


def _signed_frames(key: bytes = KEY) -> tuple[bytes, list[list[bytes]], wire.FrameMac]:
    """A valid signed header and the sealed KV frames (one per layer) plus DONE of a 10-token transfer."""
    hdr = wire.sign_header(header(), key)
    mac = wire.FrameMac(key, hdr.auth)
    k, v = kv_data(10)
    frames = [mac.seal(kv_frame(layer, 0, k[layer], v[layer])) for layer in range(L)]
    frames.append(mac.seal(wire.frame_parts(wire.DONE, b'{"frames": 4}')))
    return wire.json_frame(wire.HEADER, hdr.to_json()), frames, mac


def _splice(frames_fn):
    """Send the valid header, then whatever `frames_fn(frames)` makes of the sealed frames."""
    head, frames, _ = _signed_frames()

    def send(port):
        with _connect(port) as s:
            s.sendall(head)
            assert _read_frame(s)[0] == wire.ACK
            try:  # the receiver hangs up at the first bad frame
                for f in frames_fn(frames):
                    s.sendall(b"".join(bytes(p) for p in f))
                s.recv(1 << 16)
            except ConnectionError:
                pass
    return send


def test_sealed_frames_as_sent_are_accepted():
    got = asyncio.run(receive(_splice(lambda frames: frames)))
    k, _ = kv_data(10)
    assert np.array_equal(got.keys, k)


def _flip_payload(frame: list[bytes]) -> list[bytes]:
    """Change a payload byte, as an on-path attacker would (a tagged frame has no checksum to fix); the tag stays."""
    prefix, body, tag = frame[0], bytearray(b"".join(frame[1:-1])), frame[-1]
    body[-1] ^= 1
    return [prefix, bytes(body), tag] if prefix[0] == wire.KV else frame


@pytest.mark.parametrize("attack", ["flip payload", "reorder", "drop a frame", "replay a frame", "strip tags",
                                    "frame from another stream"])
def test_spliced_or_altered_frames_fail_the_transfer(attack):
    _, other, _ = _signed_frames(OTHER_KEY)
    attacks = {
        "flip payload": lambda f: [f[0], _flip_payload(f[1]), *f[2:]],
        "reorder": lambda f: [f[1], f[0], *f[2:]],
        "drop a frame": lambda f: [f[0], *f[2:]],
        "replay a frame": lambda f: [f[0], f[0], *f[1:]],
        "strip tags": lambda f: [p[:-1] for p in f],
        "frame from another stream": lambda f: [other[0], *f[1:]],
    }
    with pytest.raises(TransferError) as e:
        asyncio.run(receive(_splice(attacks[attack])))
    assert e.value.reason == "kv_error"
    if attack == "replay a frame":  # its tokens are claimed before its tag lands, so the overlap refuses it first
        assert "overlaps tokens already received" in str(e.value)
    elif attack != "strip tags":  # without tags the stream desynchronizes; it fails either way
        assert "frame authentication failed" in str(e.value)


def test_a_replayed_header_cannot_restart_a_transfer_in_flight():
    """An on-path attacker replays the genuine header on a second connection: refused, buffers untouched."""
    head, frames, _ = _signed_frames()

    def send(port):
        with _connect(port) as first:
            first.sendall(head)
            assert _read_frame(first)[0] == wire.ACK
            with _connect(port) as second:
                second.sendall(head)
                ftype, body = _read_frame(second)
                assert ftype == wire.ERROR and "already streaming" in body["message"]

    with pytest.raises(TransferError, match="already streaming"):
        asyncio.run(receive(send))


def test_open_header_json_is_unchanged_and_auth_fields_are_checked():
    assert set(header().to_json()) == {"transfer_id", "fingerprint", "num_layers", "num_kv_heads", "head_dim",
                                       "dtype", "start", "num_tokens", "version"}
    signed = wire.sign_header(header(), KEY)
    assert wire.StreamHeader.from_json(signed.to_json()) == signed and wire.header_auth_ok(signed, KEY)
    assert wire.StreamHeader.from_json(header().to_json()).auth is None
    for bad in ({"auth": "zz" * 32}, {"auth": "AB" * 32}, {"auth": "é" * 64}, {"auth": 5},
                {"frame_mac": True}, {"frame_mac": "yes", "auth": "ab" * 32}, {"transfer_id": ["t1"]}):
        with pytest.raises(wire.WireError):
            wire.StreamHeader.from_json({**header().to_json(), **bad})
