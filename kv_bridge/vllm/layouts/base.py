"""Interface of a paged-KV layout adapter: one request's tokens of one layer -> (H, T, D) K and V.

Adapters only index, slice, permute and reshape, so the same code runs on numpy arrays (tests, benchmarks,
the CPU engine) and on torch tensors (on the GPU, before the device-to-host copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def permute(x, axes: tuple[int, ...]):
    """x.permute(*axes) for torch tensors, x.transpose(axes) for numpy arrays."""
    return x.permute(*axes) if hasattr(x, "permute") else x.transpose(axes)


@dataclass(frozen=True)
class PagedLayout:
    block_size: int
    num_kv_heads: int
    head_dim: int

    def split(self, blocks, off: int, n: int):
        """K, V of `n` tokens starting `off` tokens into `blocks` (the request's pages, in block order).

        blocks: the engine's per-layer cache indexed by the request's block ids, e.g. kv_layer[block_ids].
        Returns (H, n, D) arrays/tensors of the cache dtype; not necessarily contiguous.
        """
        raise NotImplementedError

    def rows(self, kv_layer, b, h, o):
        """K, V (N, D) of the N (block, head, offset) triples (index arrays/tensors): one gather each, no copy of
        the cache; for a step's requests at once (extract.py), in whatever order the triples come."""
        raise NotImplementedError

    def check(self, kv_layer_shape: tuple[int, ...]) -> None:
        """Refuse a per-layer cache whose shape this adapter does not describe."""
        raise NotImplementedError

    def block_span(self, block_ids: list[int], start: int, end: int) -> tuple[np.ndarray, int]:
        """Block ids covering [start, end) and the offset of `start` inside the first of them."""
        first, last = start // self.block_size, (end - 1) // self.block_size
        if last >= len(block_ids):
            raise ValueError(f"tokens up to {end} need {last + 1} blocks, request has {len(block_ids)}")
        return np.asarray(block_ids[first:last + 1], dtype=np.int64), start - first * self.block_size

    def gather(self, kv_layer: np.ndarray, block_ids: list[int], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """numpy convenience: contiguous (H, end - start, D) copies of K and V for tokens [start, end)."""
        blocks, off = self.block_span(block_ids, start, end)
        k, v = self.split(kv_layer[blocks], off, end - start)
        return np.ascontiguousarray(k), np.ascontiguousarray(v)
