"""vLLM CPU attention backend (CPU_ATTN, layout LBHNC), kernel ISA "vec", paged layout: the same for every dtype.

vLLM [num_blocks, H, block, 2 * D] per layer; inside each (block, head) row of 2 * block * D values:
K stored transposed as [D, block], then V as [block, D] (csrc/cpu/cpu_attn_vec.hpp reshape_and_cache, one element
at a time whatever the dtype). Verified against MLX-computed KV for float32, bfloat16 and fp8 caches in tests.
-> wire/mlx (H, T, D) for K and V. The AMX ISA packs blocks differently and is refused (layouts/__init__.py).
"""

from __future__ import annotations

import numpy as np

from kv_bridge.vllm.layouts.base import PagedLayout, permute


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

    def rows(self, kv_layer, b, h, o):
        nb, hh, bs, d = kv_layer.shape[0], self.num_kv_heads, self.block_size, self.head_dim
        rows = kv_layer.reshape(nb, hh, 2, bs * d)  # a view: the engine's cache is contiguous
        k = rows[:, :, 0].reshape(nb, hh, d, bs)[b, h, :, o]   # K[d, o] at d * bs + o -> (N, D)
        v = rows[:, :, 1].reshape(nb, hh, bs, d)[b, h, o]      # (N, D)
        return k, v

    def gather(self, kv_layer: np.ndarray, block_ids: list[int], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """One pass: each run of consecutive block ids is a view of the cache, transposed straight into the
        preallocated (H, end - start, D) outputs (the generic path copies the blocks, then the transpose)."""
        h, bs, d, n = self.num_kv_heads, self.block_size, self.head_dim, end - start
        k_out, v_out = np.empty((h, n, d), kv_layer.dtype), np.empty((h, n, d), kv_layer.dtype)
        blocks, off = self.block_span(block_ids, start, end)
        i = 0
        while i < len(blocks):
            j = i + 1
            while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
                j += 1
            k, v = self.split(kv_layer[blocks[i]:blocks[i] + (j - i)], 0, (j - i) * bs)  # views, (H, run, D)
            lo, hi = max(i * bs, off), min(j * bs, off + n)  # this run's tokens, counted from the first block
            k_out[:, lo - off:hi - off] = k[:, lo - i * bs:hi - i * bs]
            v_out[:, lo - off:hi - off] = v[:, lo - i * bs:hi - i * bs]
            i = j
        return k_out, v_out

    def scatter(self, kv_layer: np.ndarray, block_ids: list[int], start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Inverse of gather (builds synthetic paged caches for tests and benchmarks)."""
        bs, d = self.block_size, self.head_dim
        for i in range(k.shape[1]):
            pos = start + i
            b, o = block_ids[pos // bs], pos % bs
            flat = kv_layer[b].reshape(self.num_kv_heads, 2 * bs * d)
            flat[:, o: bs * d: bs] = k[:, i]                                # K[:, d, o] lives at d * bs + o
            flat[:, bs * d + o * d: bs * d + (o + 1) * d] = v[:, i]
