"""Gather one layer's KV of all of a step's sending requests out of vLLM's paged cache into host memory, in the
wire dtype (torch): one block-id upload, one gather, one device-to-host copy into a reused pinned buffer per step.

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
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pinned = PinnedPool() if self.cuda else None

    def extract(self, kv_layer: torch.Tensor, block_ids: list[int], start: int, end: int,
                scales: tuple[float, float]) -> HostKV:
        """One request's tokens [start, end): extract_batch with one span."""
        return self.extract_batch(kv_layer, [Span(block_ids, start, end)], scales).parts[0]

    def extract_batch(self, kv_layer: torch.Tensor, spans: list[Span], scales: tuple[float, float]) -> HostBatch:
        """Every span's (H, n, D) K and V of this layer, gathered at once."""
        picked = [self.layout.block_span(s.block_ids, s.start, s.end) for s in spans]
        idx = torch.from_numpy(np.concatenate([b for b, _ in picked]))
        if self.cuda:
            idx = idx.pin_memory().to(kv_layer.device, non_blocking=True)
        blocks = kv_layer[idx]  # the one gather, on the compute stream: done before vLLM can reuse any block
        parts, first = [], 0
        for (b, off), s in zip(picked, spans):
            parts.append(self._convert(blocks[first:first + len(b)], off, s.end - s.start, scales))
            first += len(b)
        if not self.cuda:  # already host tensors: numpy views of them, no further copy
            return HostBatch([HostKV(*(_host(t) for t in p), _noop) for p in parts], None,
                             sum(t.numel() * t.element_size() for p in parts for t in p))
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in _packed(parts)])  # one buffer: one D2H copy
        host = self.pinned.take(flat.numel())
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(torch.cuda.current_stream())
            host[:flat.numel()].copy_(flat, non_blocking=True)
            flat.record_stream(self.stream)  # `flat` lives on the main stream's allocator until the copy is done
            event = torch.cuda.Event()
            event.record(self.stream)
        return HostBatch(_unpack(host, parts, event.synchronize), lambda: self.pinned.give(host), flat.numel())

    def _convert(self, blocks: torch.Tensor, off: int, n: int, scales: tuple[float, float]):
        """(K, V, scales) of one span on the cache's device, in the wire dtype; never synchronizes with the host."""
        k, v = self.layout.split(blocks, off, n)
        k, v = k.contiguous(), v.contiguous()
        if self.cache_is_fp8:  # stored bytes and the layer's current scales travel as they are
            return k.view(torch.uint8), v.view(torch.uint8), torch.tensor(scales, dtype=torch.float32,
                                                                          device=k.device)
        if self.wire_dtype == "float8_e4m3":
            (k, ks), (v, vs) = _to_fp8(k), _to_fp8(v)
            return k, v, torch.stack([ks, vs])
        return k, v, torch.ones(2, dtype=torch.float32, device=k.device)


def _packed(parts: list) -> list[torch.Tensor]:
    """Order in the flat buffer: every part's float32 scales first (keeps each piece aligned), then K, V of each."""
    return [p[2] for p in parts] + [t for p in parts for t in p[:2]]


def _unpack(host: torch.Tensor, parts: list, ready: Callable[[], None]) -> list[HostKV]:
    """numpy views of each part's K, V and scales inside the flat host buffer (laid out as `_packed`)."""
    views, pos = [], 0
    for t in _packed(parts):
        nb = t.numel() * t.element_size()
        views.append(_host(host[pos:pos + nb].view(t.dtype).view(t.shape)))
        pos += nb
    n = len(parts)
    return [HostKV(views[n + 2 * i], views[n + 2 * i + 1], views[i], ready) for i in range(n)]


def _to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frame scaled fp8 e4m3: x ~= code * scale, scale = amax / 448 (a device scalar: no host sync)."""
    scale = (x.abs().amax().float() / E4M3_MAX).clamp_min(1e-12)
    return (x.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8), scale


def _host(t: torch.Tensor) -> np.ndarray:
    """numpy view of a host tensor; bfloat16 as its raw uint16 bits (numpy has no bfloat16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    a = t.numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a
