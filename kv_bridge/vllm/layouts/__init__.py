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


def layout_for(backend: str, block_size: int, num_kv_heads: int, head_dim: int, layout: str = "LBHNC") -> PagedLayout:
    """The adapter for (backend, layout); an unknown pair is refused with a message that names it."""
    layout = _ALIASES.get(layout, layout)
    cls = LAYOUTS.get((backend, layout))
    if cls is None:
        known = ", ".join(f"{b}/{o}" for b, o in sorted(LAYOUTS))
        raise ValueError(f"no KV layout adapter for attention backend {backend!r} with cache layout {layout!r}; "
                         f"supported: {known} (add one in kv_bridge/vllm/layouts/)")
    return cls(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
