"""Decode-side KV receiver: a TCP server whose every connection, one stream of a transfer (kv_bridge/assembly.py),
is read on a thread of its own straight into the transfer's arrays; the event loop hears only of whole transfers.

A transfer is registered (`expect`) before the prefill side connects; its streams land in preallocated buffers
(L, H, T, D), handed over only when every layer, head and token is covered (never partial KV). With a key (the node
secret's KV key), a stream whose header is not authenticated is refused before any payload.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

from kv_bridge import dtypes, wire
from kv_bridge.assembly import BufferPool, ReceivedKV, Transfer, TransferError
from kv_bridge.config.nodes import KVConfig

__all__ = ["BufferPool", "KVCapacityError", "KVReceiver", "ReceivedKV", "Transfer", "TransferError"]

log = logging.getLogger(__name__)

STAGE_BYTES = 64 << 10  # a read whose target has less left than this goes through a staging buffer (see _fill)
HEADER_WAIT_S = 30.0  # a connection that sends no complete HEADER within this is dropped (its thread ends)
MAX_CONNECTIONS = 256  # open KV connections (threads) at once; more are closed at accept, before any thread starts


class KVCapacityError(RuntimeError):
    """Accepting this transfer would put the node's in-flight KV over `kv.max_inflight_bytes`: refuse, retry later."""


class KVReceiver:
    """TCP server on the decode node's kv_port; one connection carries one stream of one transfer.

    The loop only accepts; each connection is a `_Connection` thread that recv_into()s every KV payload straight
    into the transfer's arrays, checksum or tag updated read by read. The loop is woken once per transfer (its
    future settled), not once per read: on 2 cores the per-read wakes handed the GIL back and forth with the
    sender's thread (bench/bench_transfer.py).
    """

    connection_cls: type = None  # _Connection (set below); a test or profiler may substitute a subclass
    max_connections = MAX_CONNECTIONS

    def __init__(self, cfg: KVConfig, key: bytes | None = None, frame_mac: bool = True):
        self.cfg = cfg
        self.key = key  # None: streams are open (loopback-only deployments)
        self.require_frame_mac = frame_mac
        self.transfers: dict[str, Transfer] = {}
        self._reserved: dict[str, int] = {}  # transfer id -> KV bytes it may hold (in its decode KV dtype)
        self.pool = BufferPool(cfg.pool_bytes) if cfg.pool_bytes else None
        self._listeners: list[socket.socket] = []
        self._accepting: list[asyncio.Task] = []
        self._conns: set[_Connection] = set()

    @property
    def inflight_bytes(self) -> int:
        return sum(self._reserved.values())

    async def start(self, host: str, port: int) -> None:
        """Listen on every address `host` resolves to (as asyncio's create_server would)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, kind, proto, _, addr in dict.fromkeys(infos):
                s = socket.socket(family, kind, proto)
                self._listeners.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind(addr)
                s.listen(100)
                s.setblocking(False)
        except OSError:
            for s in self._listeners:
                s.close()
            self._listeners = []
            raise
        self._accepting = [loop.create_task(self._accept(s)) for s in self._listeners]

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as e:  # e.g. out of file descriptors: keep serving
                log.warning("KV receiver: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            if len(self._conns) >= self.max_connections:  # e.g. a peer opening connections it never uses
                log.warning("KV receiver: %d connections open already; refusing another", len(self._conns))
                sock.close()
                continue
            conn = self.connection_cls(self, sock)
            self._conns.add(conn)
            conn.thread.start()

    async def stop(self) -> None:
        """Stop accepting, fail open transfers, drop every connection and wait for their threads to end."""
        for task in self._accepting:
            task.cancel()
        await asyncio.gather(*self._accepting, return_exceptions=True)
        for s in self._listeners:
            s.close()
        self._accepting, self._listeners = [], []
        for t in list(self.transfers.values()):
            t.fail("kv_aborted", "decode node shutting down")
        conns = list(self._conns)
        for c in conns:
            c.shutdown()
        await asyncio.to_thread(lambda: [c.thread.join(10) for c in conns])

    def expect(self, transfer_id: str, num_tokens: int, spec: dict, start: int = 0,
               dtype: str = "float32", exempt: bool = False) -> Transfer:
        """Register the transfer of prompt tokens [start, num_tokens) before the prefill side connects, to be held
        in `dtype` (the model's compute dtype: dtypes.TARGETS); KVCapacityError when its KV would put the node over
        `kv.max_inflight_bytes`, unless `exempt` (the fidelity canary's few hundred tokens: reserved, never refused,
        so a busy node's pair is still checked)."""
        if transfer_id in self.transfers:
            raise ValueError(f"transfer {transfer_id!r} is already registered")
        # the prefill nodes' EAGLE-3 head sends its prompt KV as draft_layers more layers of the model's shape
        layers = spec["num_layers"] + spec.get("draft_layers", 0)
        per_token = 2 * layers * spec["num_kv_heads"] * spec["head_dim"] * dtypes.target_itemsize(dtype)
        need = per_token * (num_tokens - start)  # K and V as held, every layer at full length
        held = self.inflight_bytes
        if held + need > self.cfg.max_inflight_bytes and not exempt:
            raise KVCapacityError(f"this decode node holds {held} bytes of in-flight KV; {need} more would pass its "
                                  f"kv.max_inflight_bytes of {self.cfg.max_inflight_bytes}")
        t = Transfer(transfer_id, num_tokens, spec, self.cfg, start, self.pool, dtype)
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


class _Eof(ConnectionError):
    """The peer closed the connection (or shutdown() dropped it)."""


class _Connection:
    """One KV connection on its own thread: HEADER (answered ACK or ERROR), then KV* and DONE.

    The thread reads each piece of a frame where it belongs: the 5-byte prefix, then either the whole body into
    `_buf` (reused, grown to the largest frame after the prefix's length passed its bound), or, for a KV frame in
    the transfer's own dtype, its 20-byte KV prefix and then the payload straight into its arrays, in contiguous pieces
    (`Transfer.views`), each read checksummed (and MACed) as it lands, while its bytes are still in cache. A piece
    with less than STAGE_BYTES left is read through a staging buffer, together with what follows it, and copied on.
    One frame at a time, so nothing queues up here: a fast sender waits in TCP. The thread ends with its stream
    (DONE, a refusal, the peer gone) or when its transfer ends (`Transfer.on_end` -> shutdown()).
    """

    def __init__(self, rx: KVReceiver, sock: socket.socket):
        self.rx, self.sock = rx, sock
        self.transfer: Transfer | None = None
        self.hdr: wire.StreamHeader | None = None
        self.mac: wire.FrameMac | None = None
        self._small = bytearray(wire.PREFIX.size + wire.KV_PREFIX.size + wire.MAX_CHECKSUM + wire.TAG_BYTES)
        self._buf = bytearray()
        self._stage = memoryview(bytearray(STAGE_BYTES))
        self._pos = self._end = 0  # unread bytes in the staging buffer: [_pos, _end)
        self._mid_frame = False
        # The link's share of the stream's time: gaps between reads while a frame is part-read (its bytes were on
        # the way), not those between frames (the prefill computing the next layer). The learned link rate's clock.
        self.link_s, self._last_read = 0.0, None
        self._closed = False
        self._aborting = False  # this connection is failing the transfer itself: it still owes the sender its ERROR
        self.thread = threading.Thread(target=self._run, name="disagg-kv-recv", daemon=True)

    def shutdown(self) -> None:
        """Drop the connection from any thread: a read in progress returns at once and the thread ends."""
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass

    def took(self, nbytes: int) -> None:
        """Called after each read off the socket (a hook for tests)."""

    # ---- reading ----

    def _recv(self, into: memoryview) -> int:
        n = self.sock.recv_into(into)
        if n == 0:
            raise _Eof("EOF")
        now = time.perf_counter()
        if self._mid_frame and self._last_read is not None:
            self.link_s += now - self._last_read
        self._last_read = now
        self.took(n)
        return n

    def _fill(self, view: memoryview, digest=None) -> None:
        """Fill `view`: staged bytes first, then straight from the socket (a short rest through the staging
        buffer); every landed piece goes into `digest` (running checksum or tag) at once, while it is in cache."""
        got, n = 0, len(view)
        try:
            while got < n:
                if self._pos < self._end:
                    k = min(n - got, self._end - self._pos)
                    view[got:got + k] = self._stage[self._pos:self._pos + k]
                    self._pos += k
                elif n - got >= STAGE_BYTES:
                    k = self._recv(view[got:])
                else:
                    self._pos, self._end = 0, self._recv(self._stage)
                    continue
                if digest is not None:
                    digest.update(view[got:got + k])
                got += k
        except OSError:
            self._mid_frame = self._mid_frame or got > 0
            raise

    def _small_view(self, offset: int, size: int) -> memoryview:
        return memoryview(self._small)[offset:offset + size]

    # ---- frames ----

    def _run(self) -> None:
        try:
            self.sock.settimeout(HEADER_WAIT_S)
            self._serve()
        except (TransferError, wire.WireError) as e:
            self._abort(getattr(e, "reason", "kv_error"), str(e))
        except OSError as e:  # EOF, reset, the header's wait, or shutdown() once the transfer ended
            self._lost(e)
        except Exception as e:  # a bug must still fail the transfer (decode prefills locally), never hang it
            log.exception("KV receiver: connection failed")
            self._abort("kv_error", f"receiver error: {e!r}")
        finally:
            self.sock.close()
            self.rx._conns.discard(self)

    def _serve(self) -> None:
        ftype, length = self._prefix()
        body, trailer = self._body(ftype, length)
        self._check(ftype, length, [body], trailer)
        self._on_header(ftype, body)
        self.sock.settimeout(None)  # from here the transfer's own deadline decides (its end drops this connection)
        while True:
            ftype, length = self._prefix()
            t = self._live_transfer()
            if t is None:
                return
            if ftype == wire.KV and self.hdr.dtype == t.dtype:  # e.g. bf16 into a bf16 model: no conversion
                self._kv_in_place(t, length)
                continue
            body, trailer = self._body(ftype, length)
            self._check(ftype, length, [body], trailer)
            if ftype == wire.KV:
                t.add(self.hdr, *wire.parse_kv(body, self.hdr, t.dtype))  # rounded into the model's dtype
            elif ftype == wire.DONE:
                t.stream_done(self.hdr, self.link_s)
                self.transfer = None  # this stream is complete; the transfer may still wait on other ranks' streams
                return
            elif ftype == wire.ERROR:
                raise TransferError("kv_error", "prefill reported: " + str(wire.parse_json(body).get("message")))
            else:
                raise wire.WireError(f"unexpected frame type {ftype} mid-stream")

    def _prefix(self) -> tuple[int, int]:
        self._mid_frame = False
        self._fill(self._small_view(0, wire.PREFIX.size))
        self._mid_frame = True
        ftype, length = wire.PREFIX.unpack_from(self._small)
        wire.check_prefix(ftype, length, self.rx.cfg.max_frame_bytes)  # before anything is sized from it
        if self.hdr is None and ftype != wire.HEADER:
            raise wire.WireError("stream must open with a HEADER frame")
        return ftype, length

    def _body(self, ftype: int, length: int) -> tuple[memoryview, memoryview]:
        size = length + wire.trailer_size(ftype, self.mac)
        if len(self._buf) < size:
            self._buf = bytearray(size)  # grows to the largest frame of this stream, then is reused
        data = memoryview(self._buf)[:size]
        self._fill(data)
        return data[:length], data[length:]

    def _check(self, ftype: int, length: int, parts: list, trailer: memoryview) -> None:
        """Before anything reads the body: its tag with a frame MAC (which catches any corruption a checksum
        would), else its checksum."""
        if self.mac is not None:
            self.mac.check_parts(ftype, length, parts, bytes(trailer))
        else:
            wire.check_checksum(ftype, parts, trailer)

    def _kv_in_place(self, t: Transfer, length: int) -> None:
        if length < wire.KV_PREFIX.size:
            raise wire.WireError("KV frame shorter than its prefix")
        kvp = self._small_view(wire.PREFIX.size, wire.KV_PREFIX.size)
        self._fill(kvp)
        layer, start, count, _, _ = wire.parse_kv_prefix(kvp, length, self.hdr)
        views = t.views(self.hdr, layer, start, count)
        # With a frame MAC the tag is the whole check (the frame carries no checksum since wire version 4).
        if self.mac is None:
            digest = wire.kv_digest(kvp)
        else:
            digest = self.mac.begin(wire.KV, length)
            digest.update(kvp)
        for view in views:
            self._fill(view, digest)
        trailer = self._small_view(wire.PREFIX.size + wire.KV_PREFIX.size, wire.trailer_size(wire.KV, self.mac))
        self._fill(trailer)
        # The payload lands before its tag is checked, but counts only after: a bad tag fails the whole transfer,
        # whose buffers are dropped (never pooled, never decoded), so unauthenticated KV is never used.
        if self.mac is None:
            wire.check_digest(digest, trailer)
        else:
            self.mac.check_running(digest, trailer)
        t.received(self.hdr, count)

    def _live_transfer(self) -> Transfer | None:
        """The transfer, or None (the connection is then dropped) once it timed out, was aborted or forgotten."""
        return None if self.transfer.ended else self.transfer

    def _on_header(self, ftype: int, body: memoryview) -> None:
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
        if t is None or t.ended:
            raise TransferError("kv_error", f"no decode request is waiting for transfer {hdr.transfer_id!r}")
        t.check_header(hdr)
        t.begin(hdr)
        self.hdr, self.mac = hdr, mac
        # a transfer that ends early (timeout, abort, a second connection) drops this one
        t.on_end(self._transfer_ended)
        self.sock.sendall(wire.json_frame(wire.ACK, {}))

    # ---- endings ----

    def _transfer_ended(self) -> None:
        if not self._aborting:
            self.shutdown()

    def _abort(self, reason: str, msg: str) -> None:
        """Fail the transfer, then tell the sender why (best effort) and drop the connection. In that order: told, the
        sender closes its other streams, whose threads would otherwise race to fail the transfer with their EOF."""
        t = self.transfer
        if t is None or not t.ended:
            log.warning("KV transfer %s failed: %s", t.transfer_id if t else "?", msg)
        self._aborting = True
        if t is not None:
            t.fail(reason, msg)
        if not self._closed:
            try:
                self.sock.settimeout(1.0)
                self.sock.sendall(wire.json_frame(wire.ERROR, {"message": msg}))
            except OSError:
                pass

    def _lost(self, exc: OSError) -> None:
        t = self.transfer
        if t is not None and not t.ended:
            # a peer that vanished mid-frame shows up as EOF or as a reset, depending on timing
            what = "EOF" if isinstance(exc, _Eof) else type(exc).__name__
            msg = f"stream ended {'mid-frame' if self._mid_frame else 'before DONE'} (connection lost: {what})"
            log.warning("KV transfer %s failed: %s", t.transfer_id, msg)
            t.fail("kv_error", msg)


KVReceiver.connection_cls = _Connection
