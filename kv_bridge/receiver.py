"""Decode-side KV receiver: an asyncio TCP server; each connection is one stream of a transfer (kv_bridge/assembly.py).

A transfer is registered (`expect`) before the prefill side connects; its streams land in preallocated buffers
(L, H, T, D), handed over only when every layer, head and token is covered (never partial KV). With a key (the node
secret's KV key), a stream whose header is not authenticated is refused before any payload.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kv_bridge import wire
from kv_bridge.assembly import BufferPool, ReceivedKV, Transfer, TransferError
from kv_bridge.config import KVConfig

__all__ = ["BufferPool", "KVCapacityError", "KVReceiver", "ReceivedKV", "Transfer", "TransferError"]

log = logging.getLogger(__name__)

STAGE_BYTES = 64 << 10  # a read whose target has less left than this goes through a staging buffer (see get_buffer)


class KVCapacityError(RuntimeError):
    """Accepting this transfer would put the node's in-flight KV over `kv.max_inflight_bytes`: refuse, retry later."""


class KVReceiver:
    """TCP server on the decode node's kv_port; one connection carries one transfer.

    Each connection is a `_FrameProtocol`: the event loop recv_into()s every frame straight into a buffer the
    connection reuses, so a KV frame is copied once by the kernel and once into the transfer's arrays (asyncio's
    StreamReader copied it twice more; see bench/bench_transfer.py).
    """

    protocol_cls: type = None  # _FrameProtocol (set below); a test or profiler may substitute a subclass

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
        self._server = await loop.create_server(lambda: self.protocol_cls(self), host, port)

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
    float32 KV frame, its 20-byte KV prefix and then the payload straight into the transfer's arrays, in
    contiguous pieces (`Transfer.views`), each read checksummed (and MACed) as it lands, while its bytes are still
    in cache. A piece with less than STAGE_BYTES left is read through a staging buffer, together with what follows
    it, and copied on. Frames are handled synchronously as they complete, so nothing queues up here: a fast sender
    waits in TCP.
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
        self._digests, self._summed = (), 0
        self._stage = memoryview(bytearray(STAGE_BYTES))
        self._staged = False
        self._mid_frame = False
        # The link's share of the stream's time: gaps between reads while a frame is part-read (its bytes were on
        # the way), not those between frames (the prefill computing the next layer). The learned link rate's clock.
        self.link_s, self._last_read = 0.0, None
        self._closed = False
        self._expect_prefix()

    # ---- reading: fill the targets in order, then call _then ----

    def _read(self, targets: list[memoryview], then, digests=(), summed: int = 0) -> None:
        """Fill `targets` in order, then call `then`; what lands in the first `summed` targets goes into each of
        `digests` (running checksum, running tag) read by read, while its bytes are still in cache."""
        self._targets, self._ti, self._got, self._then = targets, 0, 0, then
        self._digests, self._summed = digests, summed

    def get_buffer(self, sizehint: int) -> memoryview:
        rest = self._targets[self._ti][self._got:]
        self._staged = len(rest) < STAGE_BYTES
        return self._stage if self._staged else rest

    def buffer_updated(self, nbytes: int) -> None:
        if self._closed:
            return
        now = time.perf_counter()
        if self._mid_frame and self._last_read is not None:
            self.link_s += now - self._last_read
        self._last_read = now
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
        if self._ti < self._summed:
            landed = self._targets[self._ti][self._got:self._got + nbytes]
            for d in self._digests:
                d.update(landed)
        self._got += nbytes
        if self._got < len(self._targets[self._ti]):
            return
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
        if ftype == wire.KV and self.hdr is not None and self.hdr.dtype == "float32":
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
        return wire.trailer_size(ftype, self.mac)

    def _check(self, ftype: int, length: int, parts: list, trailer: memoryview) -> None:
        """Before anything reads the body: its tag with a frame MAC (which catches any corruption a checksum
        would), else its checksum."""
        if self.mac is not None:
            self.mac.check_parts(ftype, length, parts, bytes(trailer))
        else:
            wire.check_checksum(ftype, parts, trailer)

    def _on_kv_prefix(self, length: int, kvp: memoryview) -> None:
        t = self._live_transfer()
        if t is None:
            return
        layer, start, count, _, _ = wire.parse_kv_prefix(kvp, length, self.hdr)
        views = t.views(self.hdr, layer, start, count)
        trailer = self._small_view(wire.PREFIX.size + wire.KV_PREFIX.size, self._trailer_size(wire.KV))

        # With a frame MAC the tag is the whole check (the frame carries no checksum since wire version 4).
        if self.mac is None:
            digest = wire.kv_digest(kvp)
        else:
            digest = self.mac.begin(wire.KV, length)
            digest.update(kvp)

        # The payload lands before its tag is checked, but counts only after: a bad tag fails the whole transfer,
        # whose buffers are dropped (never pooled, never decoded), so unauthenticated KV is never used.
        def done() -> None:
            if self.mac is None:
                wire.check_digest(digest, trailer)
            else:
                self.mac.check_running(digest, trailer)
            t.received(self.hdr, count)
            self._expect_prefix()
        self._read([*views, trailer], done, (digest,), len(views))

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
            t.add(self.hdr, *wire.parse_kv(body, self.hdr))
        elif ftype == wire.DONE:
            t.stream_done(self.hdr, self.link_s)
            self.transfer = None  # this stream is complete; the transfer may still wait on other ranks' streams
            self._close()
            return
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


KVReceiver.protocol_cls = _FrameProtocol
