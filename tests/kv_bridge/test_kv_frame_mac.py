"""Per-frame KV tags (wire version 4: keyed BLAKE3 chained from the HMAC-SHA256 header signature, in place of the
frame's checksum), checked against the published blake3 package; tampered, reordered or truncated frames refused
over real sockets, on the in-place (float32) and the buffered (float16) receive paths alike."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
import threading

import blake3
import numpy as np
import pytest

from kv_bridge import wire
from kv_bridge.receiver import Transfer, TransferError
from kv_bridge.sender import KVSender
from tests.support.stack import free_port
from tests.support.kv_auth import KEY, L, header, receive

N = 10


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "sender closed early"
        buf += chunk
    return bytes(buf)


def _kv(dtype: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((L, 3, N, 64)).astype(dtype) for _ in range(2))


def _sealed(dtype: str) -> tuple[bytes, list[bytes]]:
    """The signed HEADER frame and each later frame (KV per layer, DONE) as one byte string with its tag."""
    hdr = wire.sign_header(header(n=N, dtype=dtype), KEY)
    mac = wire.FrameMac(KEY, hdr.auth)
    k, v = _kv(dtype)
    frames = [mac.seal(wire.kv_frame_parts(layer, 0, k[layer], v[layer])) for layer in range(L)]
    frames.append(mac.seal(wire.frame_parts(wire.DONE, b'{"frames": 4}')))
    return wire.json_frame(wire.HEADER, hdr.to_json()), [b"".join(bytes(p) for p in f) for f in frames]


def test_sender_tags_are_keyed_blake3_chained_from_the_header_hmac():
    """What KVSender writes on a real socket, checked with hmac/hashlib and the blake3 package, not our FrameMac."""
    srv = socket.create_server(("127.0.0.1", 0))
    port, got = srv.getsockname()[1], {}

    def serve():
        conn, _ = srv.accept()
        with conn:
            ftype, length = wire.PREFIX.unpack(_recv_exact(conn, wire.PREFIX.size))
            got["header"] = json.loads(_recv_exact(conn, length + 4)[:length])
            conn.sendall(wire.json_frame(wire.ACK, {}))
            got["rest"] = b"".join(iter(lambda: conn.recv(1 << 16), b""))

    th = threading.Thread(target=serve)
    th.start()
    k, v = _kv("float32")
    s = KVSender(max_bytes=1 << 20, key=KEY)
    s.open(header(n=N), "127.0.0.1", port)
    for layer in range(L):
        s.send_layer("t1", layer, 0, k[layer], v[layer])
    s.close("t1")
    s.flush()
    s.shutdown()
    th.join(10)
    srv.close()

    hdr = got["header"]
    assert hdr["version"] == 4 and hdr["frame_mac"] is True
    fields = [hdr[f] for f in ("version", "transfer_id", "fingerprint", "num_layers", "num_kv_heads", "head_dim",
                               "dtype", "start", "num_tokens", "frame_mac")]
    signed = b"disagg kv header\0" + json.dumps(fields, separators=(",", ":")).encode()
    assert hdr["auth"] == hmac.new(KEY, signed, hashlib.sha256).hexdigest()  # the header signature is unchanged
    frame_key = blake3.blake3(KEY, derive_key_context="disagg kv frame-mac v3").digest()
    prev, rest, types = bytes.fromhex(hdr["auth"]), memoryview(got["rest"]), []
    while rest:
        ftype, length = wire.PREFIX.unpack_from(rest)
        end = wire.PREFIX.size + length  # the tag follows the body: a tagged frame carries no checksum
        body, tag = rest[wire.PREFIX.size:end], bytes(rest[end:end + 32])
        want = blake3.blake3(prev + bytes(rest[:wire.PREFIX.size]) + bytes(body), key=frame_key).digest()
        assert tag == want
        prev, rest = tag, rest[end + 32:]
        types.append(ftype)
    assert types == [wire.KV] * L + [wire.DONE]


def test_authenticated_float32_frames_are_received_in_place(monkeypatch):
    """A MAC no longer forces the body through a staging copy and Transfer.add: it lands in the transfer's arrays."""
    def refuse(*a, **kw):
        raise AssertionError("an authenticated float32 frame went through Transfer.add (a copy)")
    monkeypatch.setattr(Transfer, "add", refuse)
    k, v = _kv("float32", seed=3)

    def send(port):
        s = KVSender(max_bytes=1 << 20, key=KEY)
        s.open(header(n=N), "127.0.0.1", port)
        for layer in range(L):
            s.send_layer("t1", layer, 0, k[layer], v[layer])
        s.close("t1")
        s.flush()
        s.shutdown()
    got = asyncio.run(receive(send, n=N))
    assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)


def _flip(frame: bytes, offset: int) -> bytes:
    """Change one byte at `offset` of the body, as an on-path attacker would (no checksum to fix); the tag stays."""
    ftype, length = wire.PREFIX.unpack_from(frame)
    body = bytearray(frame[wire.PREFIX.size:wire.PREFIX.size + length])
    body[offset] ^= 1
    return frame[:wire.PREFIX.size] + bytes(body) + frame[-wire.TAG_BYTES:]


ATTACKS = {
    "tamper payload": lambda f: [f[0], _flip(f[1], -1), *f[2:]],
    "tamper KV prefix (layer)": lambda f: [f[0], _flip(f[1], 0), *f[2:]],
    "tamper tag": lambda f: [f[0], f[1][:-1] + bytes([f[1][-1] ^ 1]), *f[2:]],
    "reorder": lambda f: [f[1], f[0], *f[2:]],
    "truncate, then the rest": lambda f: [f[0], f[1][:len(f[1]) // 2], *f[2:]],
    "truncate, then close": lambda f: [f[0], f[1][:len(f[1]) // 2]],
    "truncate the tag, then close": lambda f: [*f[:-1], f[-1][:-5]],
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_tampered_reordered_or_truncated_frames_are_refused(attack, dtype):
    head, frames = _sealed(dtype)

    def send(port):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(head)
            ftype, length = wire.PREFIX.unpack(_recv_exact(s, wire.PREFIX.size))
            assert ftype == wire.ACK
            _recv_exact(s, length + 4)
            try:  # the receiver hangs up at the first bad frame
                for f in ATTACKS[attack](frames):
                    s.sendall(f)
                s.shutdown(socket.SHUT_WR)
                s.recv(1 << 16)
            except OSError:  # reset, broken pipe, or not connected any more (shutdown after the receiver hung up)
                pass

    with pytest.raises(TransferError) as e:
        asyncio.run(receive(send, n=N))
    assert e.value.reason == "kv_error"  # decode prefills locally at once; the altered KV is never used


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sealed_frames_as_sent_are_accepted(dtype):
    head, frames = _sealed(dtype)

    def send(port):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(head)
            assert wire.PREFIX.unpack(_recv_exact(s, wire.PREFIX.size))[0] == wire.ACK
            s.sendall(b"".join(frames))
            s.recv(1 << 16)
    got = asyncio.run(receive(send, n=N))
    k, _ = _kv(dtype)
    assert np.array_equal(got.keys, k.astype(np.float32))
