"""vLLM CPU attention backend (CPU_ATTN, layout LBHNC) paged layout.

vLLM [num_blocks, H, block, 2 * D] per layer; inside each (block, head) row of 2 * block * D values:
K stored transposed as [D, block], then V as [block, D]. (Verified against MLX-computed KV in tests.)
-> wire/mlx (H, T, D) for K and V.
"""

from __future__ import annotations

import numpy as np

from kv_bridge.layouts.base import PagedLayout, permute


class CpuAttnLayout(PagedLayout):
    def check(self, kv_layer_shape: tuple[int, ...]) -> None:
        want = (self.num_kv_heads, self.block_size, 2 * self.head_dim)
        if tuple(kv_layer_shape[1:]) != want:
            raise ValueError(f"CPU_ATTN KV layer has shape {tuple(kv_layer_shape)}, expected [blocks, *{want}]")

    def split(self, blocks, off: int, n: int):
        nb, h, bs, d = blocks.shape[0], self.num_kv_heads, self.block_size, self.head_dim
        rows = blocks.reshape(nb, h, 2, bs * d)
        k = permute(rows[:, :, 0].reshape(nb, h, d, bs), (1, 0, 3, 2))   # (H, nb, bs, D)
        v = permute(rows[:, :, 1].reshape(nb, h, bs, d), (1, 0, 2, 3))   # (H, nb, bs, D)
        return k.reshape(h, nb * bs, d)[:, off:off + n], v.reshape(h, nb * bs, d)[:, off:off + n]

    def scatter(self, kv_layer: np.ndarray, block_ids: list[int], start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Inverse of gather (builds synthetic paged caches for tests and benchmarks)."""
        bs, d = self.block_size, self.head_dim
        for i in range(k.shape[1]):
            pos = start + i
            b, o = block_ids[pos // bs], pos % bs
            flat = kv_layer[b].reshape(self.num_kv_heads, 2 * bs * d)
            flat[:, o: bs * d: bs] = k[:, i]                                # K[:, d, o] lives at d * bs + o
            flat[:, bs * d + o * d: bs * d + (o + 1) * d] = v[:, i]
