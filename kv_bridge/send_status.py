"""Whether each transfer's KV stream opened, told by the connector's sender (in vLLM's worker process) to the prefill
node that asked for it: one Unix datagram per stream. A stream that never opened (the decode node unreachable, the
link cut before its HEADER crossed) fails the prefill call, so the gateway aborts the transfer at once: the decode
node, which cannot tell whose connection died before a HEADER, would otherwise wait out kv_header_timeout_s."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import tempfile
import time
import uuid

log = logging.getLogger(__name__)

KEEP_S = 600.0  # an outcome nobody asked for (a probe's, a request whose call was cancelled) is forgotten after this


class StatusSink:
    """Worker side: `sink(transfer_id, error)` after each stream's HEADER was acknowledged (error None) or could not
    be; never raises (the node may have gone: the transfer's fate is then the gateway's to find)."""

    def __init__(self, path: str):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def __call__(self, transfer_id: str, error: str | None) -> None:
        try:
            self._sock.sendto(json.dumps({"tid": transfer_id, "error": error}).encode(), self.path)
        except OSError as e:
            log.debug("KV stream status of %s not told (%s): %s", transfer_id, self.path, e)


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, listener: StatusListener):
        self.listener = listener

    def datagram_received(self, data: bytes, addr) -> None:
        try:
            msg = json.loads(data)
            self.listener.record(str(msg["tid"]), msg.get("error"))
        except (ValueError, KeyError, TypeError):
            log.warning("KV stream status: unreadable datagram %r", data[:200])


class StatusListener:
    """Node side: the outcome of each transfer's stream as the sender tells it; the path goes to the connector."""

    def __init__(self):
        name = f"disagg-kv-status-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Linux's abstract namespace: no file to clean up, no TMPDIR long enough to pass AF_UNIX's 108 bytes
        self.path = "\0" + name if sys.platform.startswith("linux") else os.path.join(tempfile.gettempdir(), name)
        self._outcomes: dict[str, tuple[float, str | None]] = {}  # tid -> (when, first error or None: it opened)
        self._waiting: dict[str, asyncio.Event] = {}
        self._transport = None

    async def start(self) -> None:
        self._transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=self.path, family=socket.AF_UNIX)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        if not self.path.startswith("\0"):
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def record(self, tid: str, error: str | None) -> None:
        """The first word on a stream decides (with several ranks, any one that opened gave the decode node its
        HEADER: it then fails the transfer itself if another rank's never comes)."""
        now = time.monotonic()
        while self._outcomes:  # oldest first (insertion order): only the expired ones are looked at
            old, (when, _) = next(iter(self._outcomes.items()))
            if now - when <= KEEP_S:
                break
            del self._outcomes[old]
        self._outcomes.setdefault(tid, (now, error))
        ev = self._waiting.get(tid)
        if ev is not None:
            ev.set()

    async def failure(self, tid: str, timeout: float) -> str | None:
        """Why `tid`'s stream never opened, or None: it opened, or nothing was told within `timeout` (e.g. its
        stream still queued behind another transfer to the same decode node, which then judges it)."""
        if tid not in self._outcomes:
            ev = self._waiting.setdefault(tid, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), timeout)
            except asyncio.TimeoutError:
                return None
            finally:
                self._waiting.pop(tid, None)
        return self._outcomes.pop(tid, (0.0, None))[1]
