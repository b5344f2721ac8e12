"""Gather one request's KV of one layer out of vLLM's paged cache into host memory, in the wire dtype (torch).

On CUDA the gather and the device-to-host copy into pinned memory run on a side stream and finish with an
event, so the forward pass never waits on them; the sender's writer thread waits on the event instead.
"""

from __future__ import annotations

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


def _noop() -> None:
    return None


class Extractor:
    def __init__(self, layout: PagedLayout, wire_dtype: str, cache_is_fp8: bool, device: torch.device):
        self.layout, self.wire_dtype, self.cache_is_fp8 = layout, wire_dtype, cache_is_fp8
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def extract(self, kv_layer: torch.Tensor, block_ids: list[int], start: int, end: int,
                scales: tuple[float, float]) -> HostKV:
        blocks, off = self.layout.block_span(block_ids, start, end)
        if not self.cuda:
            parts = self._gather(kv_layer, torch.from_numpy(blocks), off, end - start, scales)
            return HostKV(*(_host(t) for t in parts), _noop)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(torch.cuda.current_stream())  # this layer's KV was written on the main stream
            idx = torch.from_numpy(blocks).to(kv_layer.device, non_blocking=True)
            host = []
            for t in self._gather(kv_layer, idx, off, end - start, scales):
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                host.append(h)
            event = torch.cuda.Event()
            event.record(self.stream)
        return HostKV(*(_host(t) for t in host), event.synchronize)

    def _gather(self, kv_layer: torch.Tensor, idx: torch.Tensor, off: int, n: int, scales: tuple[float, float]):
        """(K, V, scales) on kv_layer's device, in the wire dtype; never synchronizes with the host."""
        k, v = self.layout.split(kv_layer[idx], off, n)
        k, v = k.contiguous(), v.contiguous()
        if self.cache_is_fp8:  # stored bytes and the layer's scales travel as they are
            return k.view(torch.uint8), v.view(torch.uint8), torch.tensor(scales, dtype=torch.float32)
        if self.wire_dtype == "float8_e4m3":
            (k, ks), (v, vs) = _to_fp8(k), _to_fp8(v)
            return k, v, torch.stack([ks, vs])
        return k, v, torch.ones(2, dtype=torch.float32, device=k.device)


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
