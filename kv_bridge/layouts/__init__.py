"""Paged-KV layout adapters, one file per layout, chosen from what the engine reports (never guessed)."""

from __future__ import annotations

from kv_bridge.layouts.base import PagedLayout
from kv_bridge.layouts.cpu import CpuAttnLayout

# attention backend name as vLLM reports it (AttentionBackend.get_name()) -> adapter
LAYOUTS: dict[str, type[PagedLayout]] = {
    "CPU_ATTN": CpuAttnLayout,
}


def layout_for(backend: str, block_size: int, num_kv_heads: int, head_dim: int) -> PagedLayout:
    """The adapter for `backend`; an unknown backend is refused with a message that names it."""
    cls = LAYOUTS.get(backend)
    if cls is None:
        raise ValueError(f"no KV layout adapter for attention backend {backend!r}; "
                         f"supported: {sorted(LAYOUTS)} (add one in kv_bridge/layouts/)")
    return cls(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
