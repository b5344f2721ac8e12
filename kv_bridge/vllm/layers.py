"""Each attention layer's paged layout, from its own backend and its own cache tensor: vLLM may give layers different
backends (on GB10, gpt-oss's sink layers), and may split the scheduler's cache blocks into smaller kernel blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kv_bridge.vllm.layouts import layout_for
from kv_bridge.vllm.layouts.base import PagedLayout

log = logging.getLogger("vllm.disagg.connector")


@dataclass(frozen=True)
class LayerLayout:
    """A layer's backend (with its kernel ISA on CPU_ATTN), its adapter at the kernel block size, and the kernel
    blocks per scheduler block."""

    backend: str
    layout: PagedLayout
    ratio: int = 1

    def kernel_blocks(self, block_ids: list[int]) -> list[int]:
        """The scheduler's block ids as the kernel blocks vLLM addresses: kernel block j of block b is
        b * ratio + j (vllm/v1/worker/utils.py AttentionGroup.map_to_kernel_block_table)."""
        if self.ratio == 1:
            return block_ids
        ids = np.asarray(block_ids, dtype=np.int64)[:, None] * self.ratio + np.arange(self.ratio)
        return ids.reshape(-1).tolist()


def cache_dtype_name(t: torch.Tensor, cache_dtype: str) -> str:
    """The cache's element type as the layout registry names it: vLLM's fp8 caches are uint8 tensors, named by
    cache_config.cache_dtype ("fp8" is e4m3); others by the tensor's dtype (float32, bfloat16, float16)."""
    if cache_dtype.startswith("fp8"):
        return "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype
    return str(t.dtype).removeprefix("torch.")


def layer_layouts(kv_caches: dict[str, torch.Tensor], backends: dict[str, str], order: str, block_size: int,
                  num_kv_heads: int, head_dim: int, isas: dict[str, str | None] | None = None,
                  cache_dtype: str = "auto") -> dict[str, LayerLayout]:
    """Every layer's LayerLayout; refuses by name a layer whose backend (for CPU_ATTN: kernel ISA, as vLLM set it
    on the layer, and cache dtype) has no verified adapter or whose kernel blocks do not divide the cache block
    (`--block-size`).

    The per-layer views vLLM registers are [kernel blocks, H, kernel block, 2 * D] for every adapter: the kernel
    block size is read from the tensor itself, not assumed to be cache_config.block_size.
    """
    out: dict[str, LayerLayout] = {}
    for name, t in kv_caches.items():
        if t.dim() != 4:
            raise ValueError(f"layer {name}: KV cache view of shape {tuple(t.shape)}, the bridge reads "
                             f"[blocks, heads, block, 2 * head_dim] views")
        kernel = int(t.shape[2])
        if kernel <= 0 or block_size % kernel:
            raise ValueError(f"layer {name}: attention backend {backends[name]} uses {kernel}-token kernel blocks, "
                             f"which do not divide the {block_size}-token cache blocks; start vLLM with "
                             f"--block-size a multiple of {kernel}")
        try:
            layout = layout_for(backends[name], kernel, num_kv_heads, head_dim, order, (isas or {}).get(name),
                                cache_dtype_name(t, cache_dtype))
        except ValueError as e:
            raise ValueError(f"layer {name}: {e}") from None
        layout.check(tuple(t.shape))
        isa = (isas or {}).get(name)  # named in the start-up log: `CPU_ATTN/vec block 128 ...`
        out[name] = LayerLayout(f"{backends[name]}/{isa}" if isa else backends[name], layout, block_size // kernel)
    return out


def describe(layouts: dict[str, LayerLayout], index: dict[str, int]) -> str:
    """`FLASH_ATTN block 16 (x1): layers 0-23; TRITON_ATTN ...`: which backend and kernel block each layer got."""
    groups: dict[tuple[str, int, int], list[int]] = {}
    for name, ll in layouts.items():
        groups.setdefault((ll.backend, ll.layout.block_size, ll.ratio), []).append(index[name])
    return "; ".join(f"{b} block {bs} (x{r} per cache block): layers {_ranges(sorted(ix))}"
                     for (b, bs, r), ix in sorted(groups.items()))


def runtime() -> str:
    """The torch and CUDA the engine runs on, and the GPU (what the image carries, in the first start-up log)."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__}, no CUDA device"
    dev = torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(dev)
    return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {dev} "
            f"{torch.cuda.get_device_name(dev)} (sm_{cap[0]}{cap[1]})")


def _ranges(ix: list[int]) -> str:
    parts, lo = [], 0
    for i in range(1, len(ix) + 1):
        if i == len(ix) or ix[i] != ix[i - 1] + 1:
            parts.append(str(ix[lo]) if lo == i - 1 else f"{ix[lo]}-{ix[i - 1]}")
            lo = i
    return ",".join(parts)
