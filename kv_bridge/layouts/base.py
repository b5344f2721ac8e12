"""Interface of a paged-KV layout adapter: gather one request's tokens of one layer into (H, T, D) K and V."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PagedLayout:
    block_size: int
    num_kv_heads: int
    head_dim: int

    def gather(self, kv_layer: np.ndarray, block_ids: list[int], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K, V for token positions [start, end) of the request whose blocks are `block_ids`.

        Returns contiguous copies shaped (H, end - start, D): the paged blocks may be reused after the step.
        """
        raise NotImplementedError

    def block_span(self, block_ids: list[int], start: int, end: int) -> tuple[np.ndarray, int]:
        """Block ids covering [start, end) and the offset of `start` inside the first of them."""
        first, last = start // self.block_size, (end - 1) // self.block_size
        if last >= len(block_ids):
            raise ValueError(f"tokens up to {end} need {last + 1} blocks, request has {len(block_ids)}")
        return np.asarray(block_ids[first:last + 1], dtype=np.int64), start - first * self.block_size
