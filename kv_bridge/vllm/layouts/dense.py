"""Dense CUDA backends (FLASH_ATTN, FLASHINFER, TRITON_ATTN) in vLLM >= 0.32, any physical stride order.

vLLM hands every dense backend a per-layer *logical* view [num_blocks, H, block, 2 * D] whose content axis
holds K then V (D each); the physical order (LBHNC = "HND", LBNHC = "NHD", BLHNC, BLNHC) only changes strides,
so indexing the logical view is layout-exact. -> wire/mlx (H, T, D) for K and V.
"""

from __future__ import annotations

import numpy as np

from kv_bridge.vllm.layouts.base import PagedLayout, permute


class DenseLayout(PagedLayout):
    def check(self, kv_layer_shape: tuple[int, ...]) -> None:
        want = (self.num_kv_heads, self.block_size, 2 * self.head_dim)
        if tuple(kv_layer_shape[1:]) != want:
            raise ValueError(f"dense KV layer has logical shape {tuple(kv_layer_shape)}, expected [blocks, *{want}]")

    def split(self, blocks, off: int, n: int):
        nb, h, bs, d = blocks.shape[0], self.num_kv_heads, self.block_size, self.head_dim
        k = permute(blocks[..., :d], (1, 0, 2, 3)).reshape(h, nb * bs, d)   # (H, nb * bs, D)
        v = permute(blocks[..., d:], (1, 0, 2, 3)).reshape(h, nb * bs, d)
        return k[:, off:off + n], v[:, off:off + n]

    def rows(self, kv_layer, b, h, o):
        d = self.head_dim
        strides = kv_layer.stride() if hasattr(kv_layer, "stride") and callable(kv_layer.stride) else None
        if strides is None or strides[3] != 1 or any(x % (2 * d) for x in strides[:3]):
            return kv_layer[..., :d][b, h, o], kv_layer[..., d:][b, h, o]  # numpy, or an unusual stride order
        # Every (block, head, token) row of 2D values starts at a multiple of 2D: view the storage as rows and
        # index_select them (on CPU about 10x faster than three-tensor advanced indexing; one kernel on CUDA).
        n_rows = sum((n - 1) * x for n, x in zip(kv_layer.shape[:3], strides[:3])) // (2 * d) + 1
        flat = kv_layer.as_strided((n_rows, 2 * d), (2 * d, 1))
        r = (b * strides[0] + h * strides[1] + o * strides[2]) // (2 * d)
        return flat[:, :d].index_select(0, r), flat[:, d:].index_select(0, r)

    def scatter(self, kv_layer: np.ndarray, block_ids: list[int], start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Inverse of gather, for synthetic caches in tests and benchmarks."""
        bs, d = self.block_size, self.head_dim
        for i in range(k.shape[1]):
            b, o = block_ids[(start + i) // bs], (start + i) % bs
            kv_layer[b, :, o, :d] = k[:, i]
            kv_layer[b, :, o, d:] = v[:, i]
