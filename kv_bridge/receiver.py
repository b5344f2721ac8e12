"""Decode-side KV receiver: an asyncio TCP server that assembles frames into per-layer arrays.

A transfer is registered (`expect`) before the prefill side connects; its KV lands in preallocated
buffers (L, H, T, D) and is handed over only when every layer covers every token (never partial KV).
With a key (the node secret's KV key), a stream whose header is not authenticated is refused before any payload.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from kv_bridge import wire
from kv_bridge.config import KVConfig

log = logging.getLogger(__name__)


class TransferError(RuntimeError):
    """The transfer failed (sender error, corrupt stream, mismatch, abort); decode must prefill locally."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class ReceivedKV:
    """Complete KV for prompt tokens [start, start + T): float32 keys/values shaped (L, H, T, D)."""

    start: int
    keys: np.ndarray
    values: np.ndarray
    nbytes: int
    seconds: float  # first byte of the stream until it was complete


class Transfer:
    """One expected KV stream of prompt tokens [start, num_tokens); `result()` waits for it to complete, fail or
    time out. start > 0: the decode node already holds the prefix's KV (docs/protocol.md, kv_start)."""

    def __init__(self, transfer_id: str, num_tokens: int, spec: dict, cfg: KVConfig, start: int = 0):
        if not 0 <= start < num_tokens:
            raise ValueError(f"a transfer covers tokens [start, num_tokens) with 0 <= start < num_tokens, "
                             f"got [{start}, {num_tokens})")
        self.transfer_id = transfer_id
        self.num_tokens = num_tokens
        self.start = start
        self.spec = spec  # fingerprint, num_layers, num_kv_heads, head_dim this node decodes with
        self.cfg = cfg
        self.future: asyncio.Future[ReceivedKV] = asyncio.get_running_loop().create_future()
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())  # failures are read via result()
        self._keys = self._values = self._filled = self._hdr = None
        self._t0 = 0.0
        self._bytes = 0

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
        self._keys, self._values = np.empty(shape, np.float32), np.empty(shape, np.float32)
        self._filled = np.zeros((hdr.num_layers, hdr.num_tokens), dtype=bool)
        self._hdr = hdr
        self._t0 = time.perf_counter()

    def add(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """One frame; `start` is the absolute token position (wire.parse_kv checked it lies in the stream's range)."""
        n, i = k.shape[1], start - self.start  # buffers hold tokens [self.start, num_tokens)
        if self._filled[layer, i:i + n].any():
            raise wire.WireError(f"KV frame overlaps tokens already received (layer {layer}, start {start})")
        self._keys[layer, :, i:i + n] = k
        self._values[layer, :, i:i + n] = v
        self._filled[layer, i:i + n] = True
        self._bytes += self._hdr.kv_bytes(n)  # bytes as they crossed the network

    def finish(self) -> None:
        if not self._filled.all():
            missing = int((~self._filled).sum())
            raise wire.WireError(f"DONE before all KV arrived ({missing} layer-tokens missing)")
        self._resolve(ReceivedKV(self.start, self._keys, self._values, self._bytes, time.perf_counter() - self._t0))

    def fail(self, reason: str, message: str) -> None:
        if not self.future.done():
            self.future.set_exception(TransferError(reason, message))
        self._keys = self._values = None  # free partial buffers at once

    def _resolve(self, kv: ReceivedKV) -> None:
        if not self.future.done():
            self.future.set_result(kv)

    async def result(self, timeout: float) -> ReceivedKV:
        try:
            return await asyncio.wait_for(asyncio.shield(self.future), timeout)
        except asyncio.TimeoutError:
            self.fail("kv_timeout", f"no complete KV within {timeout:.1f}s")
            raise TransferError("kv_timeout", f"no complete KV within {timeout:.1f}s") from None


class KVReceiver:
    """TCP server on the decode node's kv_port; one connection carries one transfer."""

    def __init__(self, cfg: KVConfig, key: bytes | None = None, frame_mac: bool = True):
        self.cfg = cfg
        self.key = key  # None: streams are open (loopback-only deployments)
        self.require_frame_mac = frame_mac
        self.transfers: dict[str, Transfer] = {}
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, limit=1 << 20)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self.transfers.values()):
            t.fail("kv_aborted", "decode node shutting down")

    def expect(self, transfer_id: str, num_tokens: int, spec: dict, start: int = 0) -> Transfer:
        """Register the transfer of prompt tokens [start, num_tokens) before the prefill side connects."""
        if transfer_id in self.transfers:
            raise ValueError(f"transfer {transfer_id!r} is already registered")
        t = Transfer(transfer_id, num_tokens, spec, self.cfg, start)
        self.transfers[transfer_id] = t
        return t

    def forget(self, transfer_id: str) -> None:
        t = self.transfers.pop(transfer_id, None)
        if t is not None:
            t.fail("kv_aborted", "transfer no longer wanted")

    async def _read_frame(self, reader: asyncio.StreamReader, mac: wire.FrameMac | None = None
                          ) -> tuple[int, memoryview]:
        ftype, length = wire.PREFIX.unpack(await reader.readexactly(wire.PREFIX.size))
        wire.check_prefix(ftype, length, self.cfg.max_frame_bytes)
        tag = wire.TAG_BYTES if mac is not None else 0
        data = await reader.readexactly(length + wire.CRC.size + tag)
        body = memoryview(data)[:length]
        wire.check_crc(body, data[length:length + wire.CRC.size])
        if mac is not None:  # before anything reads the body
            mac.check(ftype, body, data[length + wire.CRC.size:])
        return ftype, body

    def _authenticate(self, hdr: wire.StreamHeader) -> wire.FrameMac | None:
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

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transfer = None
        try:
            ftype, body = await self._read_frame(reader)
            if ftype != wire.HEADER:
                raise wire.WireError("stream must open with a HEADER frame")
            hdr = wire.StreamHeader.from_json(wire.parse_json(body))
            transfer = self.transfers.get(hdr.transfer_id)
            # Authentication comes first, so an unauthenticated peer learns nothing about which transfers
            # exist; a refused stream still fails its transfer (if any): decode prefills locally at once.
            mac = self._authenticate(hdr)
            if transfer is None or transfer.future.done():
                raise TransferError("kv_error", f"no decode request is waiting for transfer {hdr.transfer_id!r}")
            transfer.check_header(hdr)
            transfer.begin(hdr)
            writer.write(wire.json_frame(wire.ACK, {}))
            await writer.drain()
            await self._read_stream(reader, hdr, transfer, mac)
        except (TransferError, wire.WireError, asyncio.IncompleteReadError, ConnectionError) as e:
            reason = getattr(e, "reason", "kv_error")
            # a peer that vanished mid-frame shows up as EOF or as a reset, depending on timing
            lost = isinstance(e, (asyncio.IncompleteReadError, ConnectionError))
            msg = f"stream ended mid-frame (connection lost: {type(e).__name__})" if lost else str(e)
            log.warning("KV transfer %s failed: %s", transfer.transfer_id if transfer else "?", msg)
            if transfer is not None:
                transfer.fail(reason, msg)
            try:
                writer.write(wire.json_frame(wire.ERROR, {"message": msg}))
                await writer.drain()
            except (ConnectionError, RuntimeError):
                pass
        finally:
            writer.close()

    async def _read_stream(self, reader, hdr: wire.StreamHeader, transfer: Transfer,
                           mac: wire.FrameMac | None) -> None:
        while not transfer.future.done():
            ftype, body = await self._read_frame(reader, mac)
            if ftype == wire.KV:
                transfer.add(*wire.parse_kv(body, hdr))
            elif ftype == wire.DONE:
                transfer.finish()
            elif ftype == wire.ERROR:
                raise TransferError("kv_error", "prefill reported: " + str(wire.parse_json(body).get("message")))
            else:
                raise wire.WireError(f"unexpected frame type {ftype} mid-stream")
