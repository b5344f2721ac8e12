"""Prefill-side KV sender: one writer thread per decode destination, its queued host memory bounded in bytes.

The forward pass only enqueues and never waits: a frame that would pass its destination's `max_bytes` fails its
transfer at once (decode prefills locally), and a destination that stops reading fails at its send timeout.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kv_bridge import wire

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    sock: socket.socket | None = None
    mac: wire.FrameMac | None = None  # tags every frame after the header when the stream is authenticated
    failed: str | None = None
    frames: int = 0
    bytes: int = 0


@dataclass
class SenderStats:
    sent_bytes: int = 0
    failed_transfers: int = 0
    peak_queued_bytes: int = 0
    finished: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class _Budget:
    """One destination's queued payload bytes, bounded: take() refuses (never waits for) an `n` that would pass the
    bound, so one stalled decode node cannot hold up the forward pass (one frame larger than the bound goes alone)."""

    def __init__(self, max_bytes: int, stats: SenderStats):
        self.max_bytes, self.used, self.stats = max_bytes, 0, stats
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used and self.used + n > self.max_bytes:
                return False
            self.used += n
            self.stats.peak_queued_bytes = max(self.stats.peak_queued_bytes, self.used)
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


class KVSender:
    """`open` / `send_layer` / `close` enqueue work on the destination's writer, which owns its sockets.

    With `key` (the node secret's KV key) every stream header is signed, and with `frame_mac` every frame is tagged.
    """

    writer_cls: type = None  # _Writer (set below); a profiler may substitute a subclass

    def __init__(self, max_bytes: int = 1 << 30, connect_timeout_s: float = 5.0, key: bytes | None = None,
                 frame_mac: bool = True, send_timeout_s: float = 10.0,
                 status: Callable[[str, str | None], None] | None = None):
        self._timeouts = (connect_timeout_s, send_timeout_s)
        self._status = status  # told each stream's opening: (transfer id, None) or (transfer id, why it could not)
        self._key, self._frame_mac = key, frame_mac
        self.stats = SenderStats()
        self._max_bytes = max_bytes  # per destination
        self._writers: dict[tuple[str, int], _Writer] = {}
        self._dest: dict[str, _Writer] = {}  # transfer id -> its destination's writer
        self._lock = threading.Lock()

    @property
    def queued_bytes(self) -> int:
        return sum(w.budget.used for w in list(self._writers.values()))

    def open(self, hdr: wire.StreamHeader, host: str, port: int) -> None:
        with self._lock:
            w = self._writers.get((host, port))
            if w is None:
                w = self._writers[(host, port)] = self.writer_cls(self, f"{host}:{port}")
            self._dest[hdr.transfer_id] = w
        w.put(("open", hdr.transfer_id, (hdr, host, port)))

    def send_layer(self, transfer_id: str, layer: int, start: int, keys: np.ndarray, values: np.ndarray,
                   scales: np.ndarray | None = None, ready=None, release: Callable[[], None] | None = None) -> None:
        """Queue one frame; `ready()` (a CUDA event's synchronize) runs on the writer before sending, `release()`
        once the frame is written or dropped (the host buffer may be reused)."""
        w = self._dest.get(transfer_id)
        if w is None or w.failed(transfer_id):  # a failed transfer's frames are dropped at once, not queued
            if release is not None:
                release()
            return
        n = keys.nbytes + values.nbytes
        if not w.budget.take(n):  # its destination is this far behind: fail the transfer rather than wait
            w.refuse(transfer_id, f"KV for {w.name} passed kv.sender_bytes ({self._max_bytes} bytes queued)")
            if release is not None:
                release()
            return
        w.put(("kv", transfer_id, (layer, start, keys, values, scales, ready, release, n)))

    def close(self, transfer_id: str, error: str | None = None) -> None:
        with self._lock:
            w = self._dest.pop(transfer_id, None)
        if w is not None:
            w.put(("close", transfer_id, error))

    def flush(self) -> None:
        """Block until everything queued so far is written (tests, shutdown)."""
        for w in list(self._writers.values()):
            w.q.join()

    def shutdown(self) -> None:
        for w in list(self._writers.values()):
            w.put(("stop", "", None))
            w.thread.join(timeout=10)


class _Writer:
    """One decode destination: a queue and the thread that writes its streams in order."""

    def __init__(self, sender: KVSender, name: str):
        self.s, self.name = sender, name
        self.q: queue.Queue = queue.Queue()
        self.streams: dict[str, _Stream] = {}
        self.budget = _Budget(sender._max_bytes, sender.stats)
        self.refused: set[str] = set()  # failed by the forward thread: their frames are dropped from then on
        self.thread = threading.Thread(target=self._run, name=f"disagg-kv-sender {name}", daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        self.q.put(item)

    def failed(self, tid: str) -> bool:
        st = self.streams.get(tid)
        return tid in self.refused or (st is not None and st.failed is not None)

    def refuse(self, tid: str, msg: str) -> None:
        """Fail a transfer from the forward thread; the writer sends its ERROR when it reaches it in the queue."""
        log.warning("KV transfer %s: %s", tid, msg)
        self.refused.add(tid)
        self.s.stats.failed_transfers += 1
        self.s.stats.failed.append(tid)
        self.put(("fail", tid, msg))

    def _run(self) -> None:
        while True:
            op, tid, arg = self.q.get()
            try:
                if op == "stop":
                    return
                self._dispatch(op, tid, arg)
            except Exception:  # the writer must outlive any one transfer's failure
                log.exception("KV sender: %s for %s failed", op, tid)
            finally:
                self.q.task_done()

    def _dispatch(self, op: str, tid: str, arg) -> None:
        if op == "open":
            self.streams[tid] = self._connect(*arg)
            return
        st = self.streams.get(tid)
        if op == "kv":
            layer, start, k, v, scales, ready, release, n = arg
            try:
                if st is not None and st.failed is None and tid not in self.refused:
                    if ready is not None:
                        ready()
                    ks, vs = (1.0, 1.0) if scales is None else (float(scales[0]), float(scales[1]))
                    self._write(st, tid, wire.frame_batches(wire.KV, wire.kv_body(layer, start, k, v, ks, vs),
                                                            st.mac))
            finally:
                self.budget.give(n)
                if release is not None:
                    release()
        elif op == "fail" and st is not None and st.failed is None:
            self.streams.pop(tid, None)
            self._finish(st, tid, arg)  # ERROR frame (if the socket still takes one), then the socket closes
        elif op == "close":
            self.refused.discard(tid)
            if st is not None:
                self.streams.pop(tid, None)
                self._finish(st, tid, arg)

    def _connect(self, hdr: wire.StreamHeader, host: str, port: int) -> _Stream:
        st, (connect_s, send_s) = _Stream(), self.s._timeouts
        if self.s._key is not None:
            hdr = wire.sign_header(hdr, self.s._key, self.s._frame_mac)
            st.mac = wire.FrameMac(self.s._key, hdr.auth) if self.s._frame_mac else None
        try:
            st.sock = socket.create_connection((host, port), timeout=connect_s)
            st.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            st.sock.sendall(wire.json_frame(wire.HEADER, hdr.to_json()))
            ftype, body = _read_frame(st.sock)
            if ftype != wire.ACK:
                raise wire.WireError("receiver refused the stream: " + str(wire.parse_json(body).get("message")))
            st.sock.settimeout(send_s)  # a receiver that stops reading fails this stream, not the others
        except (OSError, wire.WireError) as e:
            self._fail(st, hdr.transfer_id, f"cannot open KV stream to {host}:{port}: {e}")
        if self.s._status is not None:
            self.s._status(hdr.transfer_id, st.failed)
        return st

    def _write(self, st: _Stream, tid: str, batches) -> None:
        """One frame, batch by batch (wire.frame_batches: each batch hashed just before it goes)."""
        try:
            n = sum(sendall_parts(st.sock, batch) for batch in batches)
            st.frames += 1
            st.bytes += n
            self.s.stats.sent_bytes += n
        except OSError as e:
            self._fail(st, tid, f"KV stream broke or stalled: {e!r}")

    def _finish(self, st: _Stream, tid: str, error: str | None) -> None:
        if st.sock is None:
            return
        try:
            if st.failed is None:
                ftype, body = (wire.DONE, {"frames": st.frames}) if error is None else (wire.ERROR, {"message": error})
                st.sock.sendall(b"".join(b"".join(batch) for batch in
                                         wire.frame_batches(ftype, [json.dumps(body).encode()], st.mac)))
                if error is None:
                    self.s.stats.finished.append(tid)
        except OSError as e:
            self._fail(st, tid, f"KV stream broke at the end: {e!r}")
        finally:
            st.sock.close()

    def _fail(self, st: _Stream, tid: str, msg: str) -> None:
        log.warning("KV transfer %s: %s", tid, msg)
        st.failed = msg
        if st.sock is not None:
            st.sock.close()  # the receiver sees the stream end and fails the transfer at once (decode prefills)
        if tid not in self.refused:  # else refuse() counted it
            self.s.stats.failed_transfers += 1
            self.s.stats.failed.append(tid)


KVSender.writer_cls = _Writer


def sendall_parts(sock: socket.socket, parts: list) -> int:
    """Write the buffers in order with scatter-gather sendmsg (one syscall per frame, not one per piece; payloads
    go out as views of the gathered arrays, no join copy); returns the bytes written."""
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(len(v) for v in views)
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views and sent:
            views[0] = views[0][sent:]
    return total


def _read_frame(sock: socket.socket) -> tuple[int, bytes]:
    prefix = _recv_exact(sock, wire.PREFIX.size)
    ftype, length = wire.PREFIX.unpack(prefix)
    wire.check_prefix(ftype, length, 0)
    data = _recv_exact(sock, length + wire.checksum_size(ftype))
    wire.check_checksum(ftype, [data[:length]], data[length:])
    return ftype, data[:length]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise wire.WireError("connection closed by receiver")
        buf += chunk
    return bytes(buf)
