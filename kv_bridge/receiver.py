"""Decode-side KV receiver: an asyncio TCP server that assembles frames into per-layer arrays.

A transfer is registered (`expect`) before the prefill side connects; its KV lands in preallocated
buffers (L, H, T, D) and is handed over only when every layer covers every token (never partial KV).
With a key (the node secret's KV key), a stream whose header is not authenticated is refused before any payload.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kv_bridge import wire
from kv_bridge.config import KVConfig

log = logging.getLogger(__name__)

STAGE_BYTES = 64 << 10  # a read whose target has less left than this goes through a staging buffer (see get_buffer)


class TransferError(RuntimeError):
    """The transfer failed (sender error, corrupt stream, mismatch, abort); decode must prefill locally."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class BufferPool:
    """float32 receive buffers reused across transfers, up to `max_bytes` of idle ones.

    A fresh buffer costs a page fault per page as the KV lands in it, and on Linux with transparent huge pages
    sometimes a compaction stall: `bench/bench_transfer.py` saw 0.1-0.9 s for 377 MB. A buffer comes back only
    through `ReceivedKV.release()`, once its consumer has copied the KV out (never from a failed transfer, whose
    connection may still be writing into it). Thread-safe: the MLX thread releases what the event loop took.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []  # 1-D float32, smallest first
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def take(self, n: int) -> np.ndarray:
        """A 1-D float32 buffer of at least n elements (at most twice that, so small transfers do not pin big ones)."""
        with self._lock:
            for i, b in enumerate(self._free):
                if n <= b.size <= 2 * n:
                    return self._free.pop(i)
        return np.empty(n, np.float32)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if buf.nbytes > self.max_bytes:
                return
            self._free.append(buf)
            self._free.sort(key=lambda b: b.size)
            while sum(b.nbytes for b in self._free) > self.max_bytes:
                self._free.pop(0)  # keep the big ones: they are the expensive ones to fault in


@dataclass
class ReceivedKV:
    """Complete KV for prompt tokens [start, start + T): float32 keys/values shaped (L, H, T, D)."""

    start: int
    keys: np.ndarray
    values: np.ndarray
    nbytes: int
    seconds: float  # first byte of the stream until it was complete
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """The KV has been copied out: its buffers go back to the receiver's pool. keys/values are unusable after."""
        release, self._release = self._release, None
        self.keys = self.values = None
        if release is not None:
            release()


class Transfer:
    """One expected KV stream of prompt tokens [start, num_tokens); `result()` waits for it to complete, fail or
    time out. start > 0: the decode node already holds the prefix's KV (docs/protocol.md, kv_start)."""

    def __init__(self, transfer_id: str, num_tokens: int, spec: dict, cfg: KVConfig, start: int = 0,
                 pool: BufferPool | None = None):
        if not 0 <= start < num_tokens:
            raise ValueError(f"a transfer covers tokens [start, num_tokens) with 0 <= start < num_tokens, "
                             f"got [{start}, {num_tokens})")
        self.transfer_id = transfer_id
        self.num_tokens = num_tokens
        self.start = start
        self.spec = spec  # fingerprint, num_layers, num_kv_heads, head_dim this node decodes with
        self.cfg = cfg
        self.pool = pool
        self._bufs: tuple[np.ndarray, np.ndarray] | None = None  # pooled 1-D buffers behind _keys, _values
        self.future: asyncio.Future[ReceivedKV] = asyncio.get_running_loop().create_future()
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())  # failures are read via result()
        self._keys = self._values = self._filled = self._hdr = None
        self._t0 = 0.0
        self._bytes = 0
        self.progress_at = time.monotonic()  # registered, HEADER, each frame: what the no-progress deadline counts from

    def check_header(self, hdr: wire.StreamHeader) -> None:
        mine = (self.spec["fingerprint"], self.spec["num_layers"], self.spec["num_kv_heads"], self.spec["head_dim"])
        theirs = (hdr.fingerprint, hdr.num_layers, hdr.num_kv_heads, hdr.head_dim)
        if mine != theirs:
            raise TransferError("kv_error", f"model mismatch: decode node has (fingerprint, layers, kv_heads, head_dim)"
                                f"={mine}, prefill sent {theirs}")
        if hdr.start != self.start or hdr.start + hdr.num_tokens != self.num_tokens:
            raise TransferError("kv_error", f"transfer declares tokens [{hdr.start}, {hdr.start + hdr.num_tokens}), "
                                f"decode expects [{self.start}, {self.num_tokens})")
        total = hdr.kv_bytes(hdr.num_tokens, itemsize=4) * hdr.num_layers  # arrives widened to float32
        if hdr.num_tokens > self.cfg.max_tokens or total > self.cfg.max_transfer_bytes:
            raise TransferError("kv_error", f"transfer of {hdr.num_tokens} tokens / {total} bytes is over the "
                                f"configured bound ({self.cfg.max_tokens} tokens, {self.cfg.max_transfer_bytes} bytes)")

    def begin(self, hdr: wire.StreamHeader) -> None:
        if self._hdr is not None:  # a second HEADER (a replay) must not reset buffers the first stream fills
            raise TransferError("kv_error", "transfer is already streaming on another connection")
        shape = (hdr.num_layers, hdr.num_kv_heads, hdr.num_tokens, hdr.head_dim)
        if self.pool is None:
            self._keys, self._values = np.empty(shape, np.float32), np.empty(shape, np.float32)
        else:
            n = int(np.prod(shape))
            self._bufs = (self.pool.take(n), self.pool.take(n))
            self._keys, self._values = (b[:n].reshape(shape) for b in self._bufs)
        self._filled = np.zeros((hdr.num_layers, hdr.num_tokens), dtype=bool)
        self._hdr = hdr
        self._t0 = time.perf_counter()
        self.progress_at = time.monotonic()

    def add(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """One frame; `start` is the absolute token position (wire.parse_kv checked it lies in the stream's range)."""
        n, i = k.shape[1], start - self.start  # buffers hold tokens [self.start, num_tokens)
        if self._filled[layer, i:i + n].any():
            raise wire.WireError(f"KV frame overlaps tokens already received (layer {layer}, start {start})")
        self._keys[layer, :, i:i + n] = k
        self._values[layer, :, i:i + n] = v
        self._filled[layer, i:i + n] = True
        self._bytes += self._hdr.kv_bytes(n)  # bytes as they crossed the network
        self.progress_at = time.monotonic()

    def views(self, layer: int, start: int, count: int) -> list[memoryview]:
        """Where a float32 frame's payload goes, in wire order: K (count, D) for each head, then V likewise, each a
        contiguous slice of this transfer's arrays, so the frame is received in place (no copy). The tokens are
        claimed now; a frame that fails its checksum afterwards fails the whole transfer."""
        a = start - self._hdr.start
        if self._filled[layer, a:a + count].any():
            raise wire.WireError(f"KV frame overlaps tokens already received (layer {layer}, start {start})")
        self._filled[layer, a:a + count] = True
        heads = range(self._hdr.num_kv_heads)
        return [memoryview(buf[layer, h, a:a + count]).cast("B") for buf in (self._keys, self._values) for h in heads]

    def received(self, count: int) -> None:
        """A frame received in place (views()) passed its checks: count its bytes."""
        self._bytes += self._hdr.kv_bytes(count)
        self.progress_at = time.monotonic()

    def finish(self) -> None:
        if not self._filled.all():
            missing = int((~self._filled).sum())
            raise wire.WireError(f"DONE before all KV arrived ({missing} layer-tokens missing)")
        bufs, pool = self._bufs, self.pool
        release = None if bufs is None else (lambda: [pool.give(b) for b in bufs])
        self._resolve(ReceivedKV(self.start, self._keys, self._values, self._bytes, time.perf_counter() - self._t0,
                                 release))

    def fail(self, reason: str, message: str) -> None:
        if not self.future.done():
            self.future.set_exception(TransferError(reason, message))
        self._keys = self._values = None  # free partial buffers at once

    def _resolve(self, kv: ReceivedKV) -> None:
        if not self.future.done():
            self.future.set_result(kv)

    async def result(self, idle_timeout: float, header_timeout: float | None = None) -> ReceivedKV:
        """The KV, waiting as long as it makes progress: it fails (kv_timeout) only after `idle_timeout` seconds with
        nothing new (the HEADER, the last frame), never because a long live stream is slow. Before the HEADER the
        limit is `header_timeout` (default: idle_timeout): the prefill may be queued behind live work, which only the
        gateway sees, and the gateway aborts the transfer when that prefill fails (docs/routing.md)."""
        while True:
            limit = header_timeout if self._hdr is None and header_timeout is not None else idle_timeout
            left = self.progress_at + limit - time.monotonic()
            if left <= 0:
                msg = f"no KV progress for {limit:.1f}s" + (" (no HEADER)" if self._hdr is None else "")
                self.fail("kv_timeout", msg)
                raise TransferError("kv_timeout", msg)
            try:  # woken every second: a HEADER that arrived switches the limit
                return await asyncio.wait_for(asyncio.shield(self.future), min(left, 1.0))
            except asyncio.TimeoutError:
                continue


class KVCapacityError(RuntimeError):
    """Accepting this transfer would put the node's in-flight KV over `kv.max_inflight_bytes`: refuse, retry later."""


class KVReceiver:
    """TCP server on the decode node's kv_port; one connection carries one transfer.

    Each connection is a `_FrameProtocol`: the event loop recv_into()s every frame straight into a buffer the
    connection reuses, so a KV frame is copied once by the kernel and once into the transfer's arrays (asyncio's
    StreamReader copied it twice more; see bench/bench_transfer.py).
    """

    def __init__(self, cfg: KVConfig, key: bytes | None = None, frame_mac: bool = True):
        self.cfg = cfg
        self.key = key  # None: streams are open (loopback-only deployments)
        self.require_frame_mac = frame_mac
        self.transfers: dict[str, Transfer] = {}
        self._reserved: dict[str, int] = {}  # transfer id -> float32 KV bytes it may hold
        self.pool = BufferPool(cfg.pool_bytes) if cfg.pool_bytes else None
        self._server: asyncio.base_events.Server | None = None

    @property
    def inflight_bytes(self) -> int:
        return sum(self._reserved.values())

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _FrameProtocol(self), host, port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self.transfers.values()):
            t.fail("kv_aborted", "decode node shutting down")

    def expect(self, transfer_id: str, num_tokens: int, spec: dict, start: int = 0) -> Transfer:
        """Register the transfer of prompt tokens [start, num_tokens) before the prefill side connects;
        KVCapacityError when its KV would put the node over `kv.max_inflight_bytes`."""
        if transfer_id in self.transfers:
            raise ValueError(f"transfer {transfer_id!r} is already registered")
        need = 2 * spec["num_layers"] * spec["num_kv_heads"] * spec["head_dim"] * (num_tokens - start) * 4  # f32 K, V
        held = self.inflight_bytes
        if held + need > self.cfg.max_inflight_bytes:
            raise KVCapacityError(f"this decode node holds {held} bytes of in-flight KV; {need} more would pass its "
                                  f"kv.max_inflight_bytes of {self.cfg.max_inflight_bytes}")
        t = Transfer(transfer_id, num_tokens, spec, self.cfg, start, self.pool)
        self.transfers[transfer_id] = t
        self._reserved[transfer_id] = need
        return t

    def forget(self, transfer_id: str) -> None:
        """The request is over: fail the transfer if it is still open and release its reservation."""
        self._reserved.pop(transfer_id, None)
        t = self.transfers.pop(transfer_id, None)
        if t is not None:
            t.fail("kv_aborted", "transfer no longer wanted")

    def authenticate(self, hdr: wire.StreamHeader) -> wire.FrameMac | None:
        """The stream's frame MAC (None when frames carry no tags); TransferError when it may not stream."""
        if self.key is None:
            if hdr.auth is not None:
                raise TransferError("kv_error", "the sender authenticates its stream but this decode node has no "
                                    "node secret: set the same auth.node_secret on every node")
            return None
        if hdr.auth is None:
            raise TransferError("kv_error", "stream header carries no authenticator and this decode node requires "
                                "one: set the same auth.node_secret on the prefill node")
        if not wire.header_auth_ok(hdr, self.key):
            raise TransferError("kv_error", "stream header authenticator is wrong: forged, or the prefill node has "
                                "another node secret")
        if self.require_frame_mac and not hdr.frame_mac:
            raise TransferError("kv_error", "this decode node requires per-frame MACs (auth.kv_frame_mac = true) "
                                "but the sender authenticates only the header; set the same value on both")
        return wire.FrameMac(self.key, hdr.auth) if hdr.frame_mac else None


class _FrameProtocol(asyncio.BufferedProtocol):
    """One KV connection: HEADER (answered ACK or ERROR), then KV* and DONE.

    The event loop recv_into()s each piece of a frame where it belongs: the 5-byte prefix, then either the whole
    body into `_buf` (reused, grown to the largest frame after the prefix's length passed its bound), or, for a
    float32 KV frame of a stream without frame MACs, its 20-byte KV prefix and then the payload straight into
    the transfer's arrays, one contiguous piece per head (`Transfer.views`). A piece with less than STAGE_BYTES
    left is read through a staging buffer, together with what follows it, and copied on. Frames are handled
    synchronously as they complete, so nothing queues up here: a fast sender waits in TCP.
    """

    def __init__(self, rx: KVReceiver):
        self.rx = rx
        self.transport: asyncio.Transport | None = None
        self.transfer: Transfer | None = None
        self.hdr: wire.StreamHeader | None = None
        self.mac: wire.FrameMac | None = None
        self._small = bytearray(wire.PREFIX.size + wire.KV_PREFIX.size + wire.MAX_CHECKSUM + wire.TAG_BYTES)
        self._buf = bytearray()
        self._targets: list[memoryview] = []
        self._ti = self._got = 0
        self._then = None  # called once every target is full
        self._digest, self._summed = None, 0
        self._stage = memoryview(bytearray(STAGE_BYTES))
        self._staged = False
        self._mid_frame = False
        self._closed = False
        self._expect_prefix()

    # ---- reading: fill the targets in order, then call _then ----

    def _read(self, targets: list[memoryview], then, digest=None, summed: int = 0) -> None:
        """Fill `targets` in order, then call `then`; the first `summed` targets go into `digest` (a running
        checksum) each as soon as it is full, while its bytes are still in cache."""
        self._targets, self._ti, self._got, self._then = targets, 0, 0, then
        self._digest, self._summed = digest, summed

    def get_buffer(self, sizehint: int) -> memoryview:
        rest = self._targets[self._ti][self._got:]
        self._staged = len(rest) < STAGE_BYTES
        return self._stage if self._staged else rest

    def buffer_updated(self, nbytes: int) -> None:
        if self._closed:
            return
        if not self._staged:
            self._advance(nbytes)
            return
        # Small pieces (prefixes, trailers, a frame's last bytes) come in through the staging buffer together with
        # whatever follows them, and are copied on in order: one event-loop turn per recv, not one per piece.
        off = 0
        while off < nbytes and not self._closed:
            target = self._targets[self._ti]
            n = min(len(target) - self._got, nbytes - off)
            target[self._got:self._got + n] = self._stage[off:off + n]
            off += n
            self._advance(n)

    def _advance(self, nbytes: int) -> None:
        self._got += nbytes
        if self._got < len(self._targets[self._ti]):
            return
        if self._ti < self._summed:
            self._digest.update(self._targets[self._ti])
        self._ti, self._got = self._ti + 1, 0
        if self._ti < len(self._targets):
            return
        try:
            self._then()
        except (TransferError, wire.WireError) as e:
            self._abort(getattr(e, "reason", "kv_error"), str(e))

    def connection_made(self, transport) -> None:
        self.transport = transport

    # ---- frames ----

    def _small_view(self, offset: int, size: int) -> memoryview:
        return memoryview(self._small)[offset:offset + size]

    def _expect_prefix(self) -> None:
        self._mid_frame = False
        self._read([self._small_view(0, wire.PREFIX.size)], self._on_prefix)

    def _on_prefix(self) -> None:
        self._mid_frame = True
        ftype, length = wire.PREFIX.unpack_from(self._small)
        wire.check_prefix(ftype, length, self.rx.cfg.max_frame_bytes)  # before anything is sized from it
        # In place only without frame MACs: an authenticated frame is checked whole before any of it is looked at.
        if ftype == wire.KV and self.hdr is not None and self.hdr.dtype == "float32" and self.mac is None:
            if length < wire.KV_PREFIX.size:
                raise wire.WireError("KV frame shorter than its prefix")
            kvp = self._small_view(wire.PREFIX.size, wire.KV_PREFIX.size)
            self._read([kvp], lambda: self._on_kv_prefix(length, kvp))
            return
        size = length + self._trailer_size(ftype)
        if len(self._buf) < size:
            self._buf = bytearray(size)  # grows to the largest frame of this stream, then is reused
        self._read([memoryview(self._buf)[:size]], lambda: self._on_body(ftype, length))

    def _trailer_size(self, ftype: int) -> int:
        return wire.checksum_size(ftype) + (wire.TAG_BYTES if self.mac is not None else 0)

    def _check(self, ftype: int, length: int, parts: list, trailer: memoryview) -> None:
        n = wire.checksum_size(ftype)
        wire.check_checksum(ftype, parts, trailer[:n])
        if self.mac is not None:  # before anything reads the body
            self.mac.check_parts(ftype, length, parts, bytes(trailer[n:]))

    def _on_kv_prefix(self, length: int, kvp: memoryview) -> None:
        t = self._live_transfer()
        if t is None:
            return
        layer, start, count, _, _ = wire.parse_kv_prefix(kvp, length, self.hdr)
        views = t.views(layer, start, count)
        trailer = self._small_view(wire.PREFIX.size + wire.KV_PREFIX.size, self._trailer_size(wire.KV))

        digest = wire.kv_digest(kvp)  # this path has no frame MAC: the checksum is the whole check

        def done() -> None:
            wire.check_digest(digest, trailer)
            t.received(count)
            self._expect_prefix()
        self._read([*views, trailer], done, digest, len(views))

    def _on_body(self, ftype: int, length: int) -> None:
        data = memoryview(self._buf)
        body = data[:length]
        self._check(ftype, length, [body], data[length:length + self._trailer_size(ftype)])
        if self.hdr is None:
            self._on_header(ftype, body)
            self._expect_prefix()
            return
        t = self._live_transfer()
        if t is None:
            return
        if ftype == wire.KV:
            t.add(*wire.parse_kv(body, self.hdr))
        elif ftype == wire.DONE:
            t.finish()
            self._close()
        elif ftype == wire.ERROR:
            raise TransferError("kv_error", "prefill reported: " + str(wire.parse_json(body).get("message")))
        else:
            raise wire.WireError(f"unexpected frame type {ftype} mid-stream")
        self._expect_prefix()

    def _live_transfer(self) -> Transfer | None:
        """The transfer, or None (and the connection dropped) once it timed out, was aborted or forgotten."""
        if self.transfer.future.done():
            self._close()
            return None
        return self.transfer

    def _on_header(self, ftype: int, body: memoryview) -> None:
        if ftype != wire.HEADER:
            raise wire.WireError("stream must open with a HEADER frame")
        obj = wire.parse_json(body)
        try:
            hdr = wire.StreamHeader.from_json(obj)
        except wire.WireError:  # e.g. a peer of another wire version: its transfer (if any) fails now, by name
            tid = obj.get("transfer_id")
            self.transfer = self.rx.transfers.get(tid) if isinstance(tid, str) else None
            raise
        t = self.rx.transfers.get(hdr.transfer_id)
        # Authentication comes first, so an unauthenticated peer learns nothing about which transfers exist;
        # a refused stream still fails its transfer (if any): decode prefills locally at once.
        self.transfer = t
        mac = self.rx.authenticate(hdr)
        if t is None or t.future.done():
            raise TransferError("kv_error", f"no decode request is waiting for transfer {hdr.transfer_id!r}")
        t.check_header(hdr)
        t.begin(hdr)
        self.hdr, self.mac = hdr, mac
        # a transfer that ends early (timeout, abort, a second connection) drops this connection at once
        t.future.add_done_callback(lambda f: self._close())
        self.transport.write(wire.json_frame(wire.ACK, {}))

    # ---- endings ----

    def _abort(self, reason: str, msg: str) -> None:
        """Fail the transfer, tell the sender why (best effort) and drop the connection."""
        t = self.transfer
        log.warning("KV transfer %s failed: %s", t.transfer_id if t else "?", msg)
        if t is not None:
            t.fail(reason, msg)
        if not self._closed and not self.transport.is_closing():
            self.transport.write(wire.json_frame(wire.ERROR, {"message": msg}))
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport.close()

    def eof_received(self) -> bool:
        self.connection_lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        t = self.transfer
        if t is not None and not t.future.done():
            # a peer that vanished mid-frame shows up as EOF or as a reset, depending on timing
            what = type(exc).__name__ if exc is not None else "EOF"
            where = "mid-frame" if self._mid_frame or self._got else "before DONE"
            msg = f"stream ended {where} (connection lost: {what})"
            log.warning("KV transfer %s failed: %s", t.transfer_id, msg)
            t.fail("kv_error", msg)
        self._closed = True
        self._buf = bytearray()
        self._targets = []
