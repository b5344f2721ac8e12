"""vLLM CPU attention backend (CPU_ATTN) paged layout.

vLLM [num_blocks, H, block, 2 * D] per layer; inside each (block, head) row of 2 * block * D values:
K stored transposed as [D, block], then V as [block, D]. (Verified against MLX-computed KV in tests.)
-> wire/mlx (H, T, D) for K and V.
"""

from __future__ import annotations

import numpy as np

from kv_bridge.layouts.base import PagedLayout


class CpuAttnLayout(PagedLayout):
    def gather(self, kv_layer: np.ndarray, block_ids: list[int], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        bs, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if kv_layer.shape[1:] != (h, bs, 2 * d):
            raise ValueError(f"CPU_ATTN KV layer has shape {kv_layer.shape}, expected [blocks, {h}, {bs}, {2 * d}]")
        blocks, off = self.block_span(block_ids, start, end)
        n = len(blocks)
        rows = kv_layer[blocks].reshape(n, h, 2, bs * d)                   # fancy index: a copy of n blocks
        k = rows[:, :, 0].reshape(n, h, d, bs).transpose(1, 0, 3, 2)      # (H, n, bs, D)
        v = rows[:, :, 1].reshape(n, h, bs, d).transpose(1, 0, 2, 3)      # (H, n, bs, D)
        sl = slice(off, off + end - start)
        k = np.ascontiguousarray(k.reshape(h, n * bs, d)[:, sl])
        v = np.ascontiguousarray(v.reshape(h, n * bs, d)[:, sl])
        return k, v

    def scatter(self, kv_layer: np.ndarray, block_ids: list[int], start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Inverse of gather (builds synthetic paged caches for tests and benchmarks)."""
        bs, d = self.block_size, self.head_dim
        for i in range(k.shape[1]):
            pos = start + i
            b, o = block_ids[pos // bs], pos % bs
            flat = kv_layer[b].reshape(self.num_kv_heads, 2 * bs * d)
            flat[:, o: bs * d: bs] = k[:, i]                                # K[:, d, o] lives at d * bs + o
            flat[:, bs * d + o * d: bs * d + (o + 1) * d] = v[:, i]
