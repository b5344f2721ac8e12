"""Gather one layer's KV of all of a step's sending requests out of vLLM's paged cache into host memory, in the
wire dtype (torch): one index upload, one gather for K and one for V, one copy into a reused pinned buffer per step.

On CUDA the gather runs on the compute stream (so it reads the blocks before any later kernel may reuse them,
even after vLLM frees them), and only the copy to pinned memory runs on a side stream, finishing with an event
that the sender's writer waits on; the forward pass never waits on the host.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kv_bridge.dtypes import E4M3_MAX
from kv_bridge.vllm.layouts.base import PagedLayout

FP8_CACHE_DTYPES = {"fp8", "fp8_e4m3"}


def wire_dtype_for(cache_dtype: torch.dtype, kv_cache_dtype: str, wire_option: str) -> str:
    """The wire dtype for a cache: as stored (fp8 keeps its bytes and scales), or fp8 when configured."""
    if kv_cache_dtype.startswith("fp8"):
        if kv_cache_dtype not in FP8_CACHE_DTYPES:
            raise ValueError(f"KV cache dtype {kv_cache_dtype!r} is not supported by the bridge; use fp8_e4m3")
        return "float8_e4m3"
    if wire_option == "float8_e4m3":
        return "float8_e4m3"
    if wire_option != "auto":
        raise ValueError(f"kv.wire_dtype {wire_option!r} is not one of 'auto', 'float8_e4m3'")
    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if cache_dtype not in names:
        raise ValueError(f"KV cache dtype {cache_dtype} is not supported by the bridge; supported: "
                         f"{sorted(names.values())} and fp8_e4m3")
    return names[cache_dtype]


@dataclass
class HostKV:
    """Host copies, valid once `ready()` has returned (a CUDA event; a no-op on the CPU)."""

    keys: np.ndarray
    values: np.ndarray
    scales: np.ndarray  # float32 (k_scale, v_scale), filled by the same copy as the payload
    ready: Callable[[], None]


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of one request whose pages are `block_ids` (in order)."""

    block_ids: list[int]
    start: int
    end: int


class HostBatch:
    """One step's host copy of one layer for several requests. `release()` once per part hands the pinned buffer
    back to its pool when the last part has been sent (or dropped)."""

    def __init__(self, parts: list[HostKV], on_free: Callable[[], None] | None, nbytes: int):
        self.parts, self.nbytes = parts, nbytes
        self._left, self._on_free, self._lock = len(parts), on_free, threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last and self._on_free is not None:
            self._on_free()


def _noop() -> None:
    return None


class PinnedPool:
    """Pinned host buffers reused from step to step (a fresh pinned allocation costs far more than the copy)."""

    def __init__(self, keep: int = 8):
        self._free: list[torch.Tensor] = []
        self._keep, self._lock = keep, threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, b in enumerate(self._free):
                if nbytes <= b.numel() <= 2 * nbytes:
                    return self._free.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            del self._free[:-self._keep]


class Extractor:
    def __init__(self, layout: PagedLayout, wire_dtype: str, cache_is_fp8: bool, device: torch.device):
        self.layout, self.wire_dtype, self.cache_is_fp8 = layout, wire_dtype, cache_is_fp8
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # the writer sets this device by index (see _waiter)
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pinned = PinnedPool() if self.cuda else None
        self._uploads: dict[tuple, torch.Tensor] = {}  # this step's index and scale tensors, on the device

    def extract(self, kv_layer: torch.Tensor, block_ids: list[int], start: int, end: int,
                scales: tuple[float, float]) -> HostKV:
        """One request's tokens [start, end): extract_batch with one span."""
        return self.extract_batch(kv_layer, [Span(block_ids, start, end)], scales).parts[0]

    def extract_batch(self, kv_layer: torch.Tensor, spans: list[Span], scales: tuple[float, float],
                      layout: PagedLayout | None = None) -> HostBatch:
        """Every span's (H, n, D) K and V of this layer (`layout`: the layer's own, default the extractor's): one
        gather for K and one for V (straight into packed order: span by span, head by head, token by token) with
        indices uploaded once per step, one copy to a reused pinned buffer."""
        layout = layout or self.layout
        idx, counts = self._indices(spans, layout)
        k, v = layout.rows(kv_layer, idx[0], idx[1], idx[2])  # on the compute stream: read before any reuse
        k, v, sc = self._to_wire(k, v, counts, scales, layout)
        pieces = (sc, k, v)
        nbytes = sum(t.numel() * t.element_size() for t in pieces)
        if not self.cuda:  # already host tensors: numpy views of them, no further copy
            return HostBatch(_split(pieces, counts, layout, _noop), None, nbytes)
        host = self.pinned.take(nbytes)
        # The compute stream, taken before entering the side stream's context: inside it current_stream() is the
        # side stream itself, and waiting on that would let the copy overtake the gather.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            pos, views = 0, []
            for t in pieces:  # scales first: every piece stays aligned to its element size
                n = t.numel() * t.element_size()
                dst = host[pos:pos + n].view(t.dtype).view(t.shape)
                dst.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # freed only once this copy is done
                views.append(dst)
                pos += n
            event = torch.cuda.Event(blocking=True)  # the writer sleeps on it instead of spinning a core
            event.record(self.stream)
        return HostBatch(_split(views, counts, layout, _waiter(event, self.device)), lambda: self.pinned.give(host),
                         nbytes)

    def _upload(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`make()` (a host tensor) on the device, built and copied once per step: from pinned memory, non-blocking
        (a pageable copy would wait for the compute stream, i.e. sync the host with the forward pass)."""
        t = self._uploads.get(key)
        if t is None:
            if len(self._uploads) >= 8:  # a new step's spans: the last step's tensors are not asked for again
                self._uploads.clear()
            t = self._uploads[key] = make().pin_memory().to(self.device, non_blocking=True)
        return t

    def _indices(self, spans: list[Span], layout: PagedLayout) -> tuple[torch.Tensor, list[int]]:
        """(3, N) int64 (block, head, offset) of every span's tokens in packed order (span, head, token), and each
        span's token count; on CUDA uploaded once per step and layout (the same spans serve every layer)."""
        counts = [s.end - s.start for s in spans]
        if not self.cuda:
            return _index_table(spans, layout), counts
        key = ("idx", layout, tuple((tuple(s.block_ids), s.start, s.end) for s in spans))
        return self._upload(key, lambda: _index_table(spans, layout)), counts

    def _to_wire(self, k: torch.Tensor, v: torch.Tensor, counts: list[int], scales: tuple[float, float],
                 layout: PagedLayout):
        """(K, V, scales (n_spans, 2) float32) in the wire dtype; never synchronizes with the host."""
        dev, n = k.device, len(counts)
        if self.cache_is_fp8:  # stored bytes and the layer's current scales travel as they are
            sc = torch.tensor([scales] * n, dtype=torch.float32)
            return k.view(torch.uint8), v.view(torch.uint8), (self._upload(("sc", scales, n), lambda: sc)
                                                              if self.cuda else sc)
        if self.wire_dtype != "float8_e4m3":
            return k, v, torch.ones(n, 2, dtype=torch.float32, device=dev)
        qk, qv, sc, lo = [], [], [], 0  # scaled per frame: one scale per span and K/V
        for c in counts:
            rows = c * layout.num_kv_heads
            (a, ks), (b, vs) = _to_fp8(k[lo:lo + rows]), _to_fp8(v[lo:lo + rows])
            qk.append(a), qv.append(b), sc.append(torch.stack([ks, vs]))
            lo += rows
        return torch.cat(qk), torch.cat(qv), torch.stack(sc)


def _waiter(event, device: torch.device) -> Callable[[], None]:
    """The writer's wait for a copy: on the copy's own device (a new thread starts on device 0, where the wait
    would create a CUDA context on another rank's GPU), sleeping (a blocking event) rather than spinning."""
    def ready() -> None:
        if torch.cuda.current_device() != device.index:
            torch.cuda.set_device(device)
        event.synchronize()
    return ready


def _index_table(spans: list[Span], layout: PagedLayout) -> torch.Tensor:
    """Host (3, N) int64 indices of `spans`, vectorized over all spans (a Python loop per token or head costs more
    than the copy)."""
    bs, h = layout.block_size, layout.num_kv_heads
    picked = [layout.block_span(s.block_ids, s.start, s.end) for s in spans]  # refuses a bad span
    n = np.array([s.end - s.start for s in spans], dtype=np.int64)
    table = np.zeros((len(spans), max(len(b) for b, _ in picked)), dtype=np.int64)
    for i, (b, _) in enumerate(picked):
        table[i, :len(b)] = b
    offs = np.array([off for _, off in picked], dtype=np.int64)
    span = np.repeat(np.arange(len(spans)), h * n)
    j = np.arange(len(span)) - np.repeat(h * (np.cumsum(n) - n), h * n)  # row within its span
    heads, pos = j // n[span], j % n[span] + offs[span]
    return torch.from_numpy(np.stack([table[span, pos // bs], heads, pos % bs]))


def _split(pieces, counts: list[int], layout: PagedLayout, ready: Callable[[], None]) -> list[HostKV]:
    """Each span's HostKV: numpy views into the packed host scales (n, 2), K and V (N, D)."""
    sc, k, v = (_host(t) for t in pieces)
    h, d = layout.num_kv_heads, layout.head_dim
    out, lo = [], 0
    for i, c in enumerate(counts):
        rows = c * h
        out.append(HostKV(k[lo:lo + rows].reshape(h, c, d), v[lo:lo + rows].reshape(h, c, d), sc[i], ready))
        lo += rows
    return out


def _to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frame scaled fp8 e4m3: x ~= code * scale, scale = amax / 448 (a device scalar: no host sync)."""
    # 448 as a tensor on x's device, made by a fill kernel (no host copy): CUDA divides by a Python scalar as a
    # multiply by its reciprocal, one ulp off amax / 448 (0.009068081 for 0.00906808); by a device tensor, exactly.
    e4m3_max = torch.full((), E4M3_MAX, dtype=torch.float32, device=x.device)
    scale = (x.abs().amax().float() / e4m3_max).clamp_min(1e-12)
    return (x.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8), scale


def _host(t: torch.Tensor) -> np.ndarray:
    """numpy view of a host tensor; bfloat16 as its raw uint16 bits (numpy has no bfloat16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    a = t.numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a
