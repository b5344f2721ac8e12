"""Decode-side assembly of one KV transfer from its streams (one per prefill rank): coverage per layer, head and
token, receive buffers (pooled) and the hand-over of complete KV only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kv_bridge import dtypes, wire
from kv_bridge.config.nodes import KVConfig

log = logging.getLogger("kv_bridge.receiver")


class TransferError(RuntimeError):
    """The transfer failed (sender error, corrupt stream, mismatch, abort); decode must prefill locally."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class BufferPool:
    """Receive buffers (raw bytes, viewed as each transfer's KV dtype) reused across transfers, up to `max_bytes`
    of idle ones.

    A fresh buffer costs a page fault per page as the KV lands in it, and on Linux with transparent huge pages
    sometimes a compaction stall: `.venv/bin/python -m bench.bench_transfer` saw 0.1-0.9 s for 377 MB. A buffer comes back only
    through `ReceivedKV.release()`, once its consumer has copied the KV out (never from a failed transfer, whose
    connection may still be writing into it). Thread-safe: the MLX thread releases what the event loop took.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []  # 1-D uint8, smallest first
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def take(self, nbytes: int) -> np.ndarray:
        """A 1-D uint8 buffer of at least nbytes (at most twice that, so small transfers do not pin big ones)."""
        with self._lock:
            for i, b in enumerate(self._free):
                if nbytes <= b.size <= 2 * nbytes:
                    return self._free.pop(i)
        return np.empty(nbytes, np.uint8)

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
    """Complete KV for prompt tokens [start, start + T): keys/values shaped (L, H, T, D) in the decode KV dtype
    `dtype` (dtypes.TARGETS: float32, float16, or bfloat16 held as uint16 bits)."""

    start: int
    keys: np.ndarray
    values: np.ndarray
    nbytes: int  # as they crossed the network (wire dtype)
    seconds: float  # first byte of the stream until it was complete
    link_s: float = 0.0  # the slowest stream's time mid-frame (bytes on the way); gaps between frames left out
    dtype: str = "float32"
    _release: Callable[[], None] | None = field(default=None, repr=False)
    wire_dtype: str = "float32"  # how it travelled (the fidelity canary's tolerance depends on it)
    layer_first: np.ndarray | None = field(default=None, repr=False)  # per layer, the first position sent (windows)
    # the drafter's own KV of the same tokens (StreamHeader.draft_layers), (Ld, H, T, D) each, copied out of the
    # pooled buffers so they outlive release(); None when the prefill node ran no drafter
    draft_keys: np.ndarray | None = field(default=None, repr=False)
    draft_values: np.ndarray | None = field(default=None, repr=False)

    def release(self) -> None:
        """The KV has been copied out: its buffers go back to the receiver's pool. keys/values are unusable after."""
        release, self._release = self._release, None
        self.keys = self.values = None
        if release is not None:
            release()


class Transfer:
    """One expected transfer of prompt tokens [start, num_tokens), assembled from one or more streams (one per
    tensor/pipeline-parallel rank, each carrying some heads of some layers); `result()` waits for it to complete,
    fail or time out. start > 0: the decode node already holds the prefix's KV (docs/protocol.md, kv_start).

    Coverage is tracked per (layer, head, token); the transfer completes only once every position it needs arrived
    (a sliding layer needs only its window), never on one stream's DONE while another stream still owes KV.
    Thread-safe: each stream's connection thread (kv_bridge/receiver.py) claims, fills and finishes under `_lock`;
    the future is settled on the event loop that registered the transfer (one call_soon_threadsafe per transfer).
    `dtype`: the decode node's KV dtype (its model's compute dtype): buffers are allocated in it and every wire
    dtype is rounded into it on arrival (dtypes.convert); a frame already in it lands in place.
    """

    def __init__(self, transfer_id: str, num_tokens: int, spec: dict, cfg: KVConfig, start: int = 0,
                 pool: BufferPool | None = None, dtype: str = "float32"):
        if not 0 <= start < num_tokens:
            raise ValueError(f"a transfer covers tokens [start, num_tokens) with 0 <= start < num_tokens, "
                             f"got [{start}, {num_tokens})")
        self.transfer_id = transfer_id
        self.num_tokens = num_tokens
        self.start = start
        self.spec = spec  # fingerprint, num_layers, num_kv_heads, head_dim this node decodes with
        self.dtype, self.itemsize = dtype, dtypes.target_itemsize(dtype)
        self.cfg = cfg
        self.pool = pool
        self._bufs: tuple[np.ndarray, np.ndarray] | None = None  # pooled 1-D buffers behind _keys, _values
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._lock = threading.RLock()
        self.ended = False  # failed or complete: set at once by whichever thread ends it (the future follows)
        self._closers: list[Callable[[], None]] = []  # run once when it ends: drop its streams' connections
        self.future: asyncio.Future[ReceivedKV] = self._loop.create_future()
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())  # failures are read via result()
        self._keys = self._values = self._filled = self._claimed = self._first = self._layer_first = None
        self._t0 = 0.0
        self._link_s = 0.0  # the slowest stream's mid-frame time so far (`stream_done`)
        self._bytes = 0
        self._landing = 0  # frames claimed by views() whose bytes are still arriving in place
        self.draft_missing = 0  # drafter layer-head-tokens a stream's DONE came without: its KV is dropped, not the model's
        # registered, each HEADER, each frame: what the no-progress deadline counts from
        self.progress_at = time.monotonic()

    def check_header(self, hdr: wire.StreamHeader) -> None:
        mine = (self.spec["fingerprint"], self.spec["num_layers"], self.spec["num_kv_heads"], self.spec["head_dim"])
        theirs = (hdr.fingerprint, hdr.num_layers, hdr.num_kv_heads, hdr.head_dim)
        if mine != theirs:
            raise TransferError("kv_error", f"model mismatch: decode node has (fingerprint, layers, kv_heads, head_dim)"
                                f"={mine}, prefill sent {theirs}")
        if hdr.start != self.start or hdr.start + hdr.num_tokens != self.num_tokens:
            raise TransferError("kv_error", f"transfer declares tokens [{hdr.start}, {hdr.start + hdr.num_tokens}), "
                                f"decode expects [{self.start}, {self.num_tokens})")
        total = 2 * hdr.num_kv_heads * hdr.head_dim * self.itemsize * hdr.num_tokens * hdr.all_layers  # as held
        if hdr.num_tokens > self.cfg.max_tokens or total > self.cfg.max_transfer_bytes:
            raise TransferError("kv_error", f"transfer of {hdr.num_tokens} tokens / {total} bytes is over the "
                                f"configured bound ({self.cfg.max_tokens} tokens, {self.cfg.max_transfer_bytes} bytes)")

    def begin(self, hdr: wire.StreamHeader) -> None:
        """A stream opens: it claims its (layers, heads); a claim that overlaps another stream's (a replay, or two
        replicas of one head) is refused without touching what the others fill."""
        with self._lock:
            self._begin(hdr)

    def _begin(self, hdr: wire.StreamHeader) -> None:
        self._check_live()
        if self._first is None:
            self._allocate(hdr)
        elif hdr.dtype != self._first.dtype or hdr.draft_layers != self._first.draft_layers:
            raise TransferError("kv_error", f"streams of one transfer disagree on the wire dtype or drafter layers "
                                f"({hdr.dtype}, {self._first.dtype}; {hdr.draft_layers}, {self._first.draft_layers})")
        layers, heads = list(hdr.stream_layers), slice(hdr.head_start, hdr.head_start + hdr.heads)
        if self._claimed[layers, heads].any():
            raise TransferError("kv_error", "transfer is already streaming these layers and heads on another "
                                "connection")
        firsts = np.array([hdr.layer_start(x) for x in layers])  # a sliding layer's window starts late
        claimed = self._claimed[layers].any(axis=1)
        if (self._layer_first[layers][claimed] != firsts[claimed]).any():
            raise TransferError("kv_error", "streams of one transfer disagree on a layer's sliding window")
        self._claimed[layers, heads] = True
        self._layer_first[layers] = firsts
        self.progress_at = time.monotonic()

    def _allocate(self, hdr: wire.StreamHeader) -> None:
        shape = (hdr.all_layers, hdr.num_kv_heads, hdr.num_tokens, hdr.head_dim)
        storage = dtypes.TARGETS[self.dtype]
        if self.pool is None:
            self._keys, self._values = np.empty(shape, storage), np.empty(shape, storage)
        else:
            n = int(np.prod(shape)) * self.itemsize
            self._bufs = (self.pool.take(n), self.pool.take(n))
            self._keys, self._values = (b[:n].view(storage).reshape(shape) for b in self._bufs)
        self._filled = np.zeros(shape[:3], dtype=bool)
        self._claimed = np.zeros(shape[:2], dtype=bool)
        self._layer_first = np.full(shape[0], hdr.start)  # first token each layer needs (sliding: its window)
        self._first = hdr
        self._t0 = time.perf_counter()

    def _check_live(self) -> None:
        if self.ended:  # failed (timeout, abort) or complete while this stream's thread was reading
            raise TransferError("kv_aborted", "transfer already ended")

    def on_end(self, close: Callable[[], None]) -> None:
        """Call `close` (thread-safe) once the transfer ends, or now if it has."""
        with self._lock:
            if not self.ended:
                self._closers.append(close)
                return
        close()

    def _claim(self, hdr: wire.StreamHeader, layer: int, start: int, count: int) -> tuple[slice, int]:
        self._check_live()
        heads, a = slice(hdr.head_start, hdr.head_start + hdr.heads), start - self.start
        filled = self._filled[layer, heads, a:a + count]
        if filled.any():
            raise wire.WireError(f"KV frame overlaps tokens already received (layer {layer}, start {start})")
        filled[...] = True
        return heads, a

    def add(self, hdr: wire.StreamHeader, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """One frame of the stream `hdr`, already in this transfer's dtype (wire.parse_kv(..., self.dtype));
        `start` is the absolute token position (wire.parse_kv checked it lies in the stream's range)."""
        n = k.shape[1]
        with self._lock:
            heads, i = self._claim(hdr, layer, start, n)
            self._keys[layer, heads, i:i + n] = k
            self._values[layer, heads, i:i + n] = v
            self._bytes += hdr.kv_bytes(n)  # bytes as they crossed the network
        self.progress_at = time.monotonic()

    def views(self, hdr: wire.StreamHeader, layer: int, start: int, count: int) -> list[memoryview]:
        """Where a frame's payload goes when its wire dtype is this transfer's dtype, in wire order: K (count, D) for
        each of the stream's heads, then V likewise, each a contiguous slice of this transfer's arrays, so the frame
        is received in place (no copy).
        A frame of all the transfer's tokens is one slice for K and one for V: fewer, larger reads (a read per piece
        was most of a 1k-token transfer's event-loop time).
        The tokens are claimed now but count as arrived only at received(): another stream's DONE must not complete
        the transfer while this frame is still landing. A frame that fails its checksum fails the whole transfer."""
        with self._lock:
            heads, a = self._claim(hdr, layer, start, count)
            self._landing += 1
            hs, out = range(heads.start, heads.stop), []
            for buf in (self._keys, self._values):
                block = buf[layer, heads, a:a + count]
                if block.flags.c_contiguous:
                    out.append(memoryview(block).cast("B"))
                else:
                    out.extend(memoryview(buf[layer, h, a:a + count]).cast("B") for h in hs)
            return out

    def received(self, hdr: wire.StreamHeader, count: int) -> None:
        """A frame received in place (views()) passed its checks: count its bytes."""
        with self._lock:
            self._landing -= 1
            self._bytes += hdr.kv_bytes(count)
        self.progress_at = time.monotonic()

    def _missing(self, layers, heads: slice) -> int:
        return sum(int((~self._filled[layer, heads, self._layer_first[layer] - self.start:]).sum())
                   for layer in layers)

    def stream_done(self, hdr: wire.StreamHeader, link_s: float = 0.0) -> None:
        """A stream's DONE: everything it declared must have arrived; the transfer completes with its last stream
        (another stream with a frame still landing sends its own DONE after it, and that one completes it).
        `link_s`: the time that stream spent mid-frame. Streams run side by side, so the slowest one's counts."""
        with self._lock:
            self._check_live()
            self._link_s = max(self._link_s, link_s)
            heads, n = slice(hdr.head_start, hdr.head_start + hdr.heads), hdr.num_layers
            missing = self._missing([x for x in hdr.stream_layers if x < n], heads)
            if missing:
                raise wire.WireError(f"DONE before all KV arrived ({missing} layer-head-tokens missing)")
            # The drafter's layers are the model's KV's companion, never its condition: vLLM runs an EAGLE-3 head
            # only in steps whose longest sequence fits the head's max_model_len, so a long prompt (or a long one
            # batched beside it) can come without the head's KV. The model's KV stands; the decode node's head
            # then starts from its own forwards, as without a prefill-side head.
            draft = self._missing([x for x in hdr.stream_layers if x >= n], heads)
            if draft and not self.draft_missing:
                log.warning("KV transfer %s: the prefill node's drafter KV is incomplete (%d layer-head-tokens "
                            "missing: vLLM ran the head over only part of the prompt); the model's KV is kept, "
                            "the head's dropped", self.transfer_id, draft)
            self.draft_missing += draft
            if self._landing == 0 and self._missing(range(n), slice(None)) == 0 and (
                    self.draft_missing or self._missing(range(n, hdr.all_layers), slice(None)) == 0):
                self.finish()

    def finish(self) -> None:
        for layer in np.flatnonzero(self._layer_first > self.start):  # before a sliding window: nothing was sent
            self._keys[layer, :, :self._layer_first[layer] - self.start] = 0
            self._values[layer, :, :self._layer_first[layer] - self.start] = 0
        bufs, pool, n = self._bufs, self.pool, self._first.num_layers
        release = None if bufs is None else (lambda: [pool.give(b) for b in bufs])
        whole = self._first.draft_layers and not self.draft_missing
        draft = (self._keys[n:].copy(), self._values[n:].copy()) if whole else (None, None)
        kv = ReceivedKV(self.start, self._keys[:n], self._values[:n], self._bytes, time.perf_counter() - self._t0,
                        self._link_s, self.dtype, release, self._first.dtype, self._layer_first[:n].copy(), *draft)
        self._end(lambda: self.future.done() or self.future.set_result(kv))

    def fail(self, reason: str, message: str) -> None:
        with self._lock:  # one critical section: no thread sees the buffers gone but the transfer live
            self._keys = self._values = None  # free partial buffers at once (a stream still landing holds views)
            self._end(lambda: self.future.done() or self.future.set_exception(TransferError(reason, message)))

    def _end(self, settle: Callable[[], object]) -> None:
        """Mark the transfer ended, settle its future on its loop (at once when called there), drop its streams."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
            closers, self._closers = self._closers, []
        if threading.get_ident() == self._loop_thread:
            settle()
        else:
            try:
                self._loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is closed: nobody waits for this transfer any more
                pass
        for close in closers:
            close()

    async def result(self, idle_timeout: float, header_timeout: float | None = None) -> ReceivedKV:
        """The KV, waiting as long as it makes progress: it fails (kv_timeout) only after `idle_timeout` seconds with
        nothing new (a HEADER, the last frame), never because a long live stream is slow. Before the first HEADER the
        limit is `header_timeout` (default: idle_timeout): the prefill may be queued behind live work, which only the
        gateway sees, and the gateway aborts the transfer when that prefill fails (docs/routing.md)."""
        while True:
            limit = header_timeout if self._first is None and header_timeout is not None else idle_timeout
            left = self.progress_at + limit - time.monotonic()
            if left <= 0:
                msg = f"no KV progress for {limit:.1f}s" + (" (no HEADER)" if self._first is None else "")
                self.fail("kv_timeout", msg)
                raise TransferError("kv_timeout", msg)
            try:  # woken every second: a HEADER that arrived switches the limit
                return await asyncio.wait_for(asyncio.shield(self.future), min(left, 1.0))
            except asyncio.TimeoutError:
                continue


