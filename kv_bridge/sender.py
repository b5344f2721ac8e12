"""Prefill-side KV sender: a bounded queue drained by one writer thread, so the forward pass never waits
on the network (it only waits when the queue is full, which bounds host memory).
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
from dataclasses import dataclass, field

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
    finished: list[str] = field(default_factory=list)


class KVSender:
    """`open` / `send_layer` / `close` enqueue work; the writer thread owns every socket.

    With `key` (the node secret's KV key) every stream header is signed, and with `frame_mac` every frame is tagged.
    """

    def __init__(self, queue_frames: int = 256, connect_timeout_s: float = 5.0, key: bytes | None = None,
                 frame_mac: bool = True):
        self._q: queue.Queue = queue.Queue(maxsize=queue_frames)
        self._timeout = connect_timeout_s
        self._key, self._frame_mac = key, frame_mac
        self._streams: dict[str, _Stream] = {}
        self.stats = SenderStats()
        self._thread = threading.Thread(target=self._run, name="disagg-kv-sender", daemon=True)
        self._thread.start()

    def open(self, hdr: wire.StreamHeader, host: str, port: int) -> None:
        self._q.put(("open", hdr.transfer_id, (hdr, host, port)))

    def send_layer(self, transfer_id: str, layer: int, start: int, keys: np.ndarray, values: np.ndarray,
                   scales: np.ndarray | None = None, ready=None) -> None:
        """Queue one frame; `ready()` (a CUDA event's synchronize) runs on the writer thread before sending."""
        self._q.put(("kv", transfer_id, (layer, start, keys, values, scales, ready)))

    def close(self, transfer_id: str, error: str | None = None) -> None:
        self._q.put(("close", transfer_id, error))

    def flush(self) -> None:
        """Block until everything queued so far is written (tests, shutdown)."""
        self._q.join()

    def shutdown(self) -> None:
        self._q.put(("stop", "", None))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            op, tid, arg = self._q.get()
            try:
                if op == "stop":
                    return
                self._dispatch(op, tid, arg)
            except Exception:  # the writer must outlive any one transfer's failure
                log.exception("KV sender: %s for %s failed", op, tid)
            finally:
                self._q.task_done()

    def _dispatch(self, op: str, tid: str, arg) -> None:
        if op == "open":
            self._streams[tid] = self._connect(*arg)
            return
        st = self._streams.get(tid)
        if st is None:
            return
        if op == "kv" and st.failed is None:
            layer, start, k, v, scales, ready = arg
            if ready is not None:
                ready()
            ks, vs = (1.0, 1.0) if scales is None else (float(scales[0]), float(scales[1]))
            self._write(st, tid, self._seal(st, wire.kv_frame_parts(layer, start, k, v, ks, vs)))
        elif op == "close":
            self._streams.pop(tid, None)
            self._finish(st, tid, arg)

    def _connect(self, hdr: wire.StreamHeader, host: str, port: int) -> _Stream:
        st = _Stream()
        if self._key is not None:
            hdr = wire.sign_header(hdr, self._key, self._frame_mac)
            st.mac = wire.FrameMac(self._key, hdr.auth) if self._frame_mac else None
        try:
            st.sock = socket.create_connection((host, port), timeout=self._timeout)
            st.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            st.sock.sendall(wire.json_frame(wire.HEADER, hdr.to_json()))
            ftype, body = _read_frame(st.sock)
            if ftype != wire.ACK:
                raise wire.WireError("receiver refused the stream: " + str(wire.parse_json(body).get("message")))
            st.sock.settimeout(None)
        except (OSError, wire.WireError) as e:
            self._fail(st, hdr.transfer_id, f"cannot open KV stream to {host}:{port}: {e}")
        return st

    def _write(self, st: _Stream, tid: str, parts: list) -> None:
        try:
            n = sendall_parts(st.sock, parts)
            st.frames += 1
            st.bytes += n
            self.stats.sent_bytes += n
        except OSError as e:
            self._fail(st, tid, f"KV stream broke: {e}")

    @staticmethod
    def _seal(st: _Stream, parts: list) -> list:
        return parts if st.mac is None else st.mac.seal(parts)

    def _finish(self, st: _Stream, tid: str, error: str | None) -> None:
        if st.sock is None:
            return
        try:
            if st.failed is None:
                ftype, body = (wire.DONE, {"frames": st.frames}) if error is None else (wire.ERROR, {"message": error})
                st.sock.sendall(b"".join(self._seal(st, wire.frame_parts(ftype, json.dumps(body).encode()))))
                if error is None:
                    self.stats.finished.append(tid)
        except OSError as e:
            self._fail(st, tid, f"KV stream broke at the end: {e}")
        finally:
            st.sock.close()

    def _fail(self, st: _Stream, tid: str, msg: str) -> None:
        log.warning("KV transfer %s: %s", tid, msg)
        st.failed = msg
        self.stats.failed_transfers += 1


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
