"""`disagg config check`'s memory and disk budget, one machine at a time: a Mac's weights, prefix caches, in-flight
KV and receive pool against its RAM; a Spark's vLLM share against what vLLM will find free at start; folders on disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kv_bridge.config import ModelRoute, NodeConfig, Settings, resolve_model_path

GIB = 2**30


@dataclass
class Budget:
    node: str
    memory: list[tuple[str, float]]  # (what, GiB)
    available_gib: float | None
    disk: list[tuple[str, float]]
    disk_gib: float | None

    def line(self) -> str:
        need = sum(g for _, g in self.memory)
        have = "?" if self.available_gib is None else f"{self.available_gib:.1f}"
        parts = " + ".join(f"{what} {g:.1f}" for what, g in self.memory)
        return f"  {self.node}: memory {need:.1f} of {have} GiB ({parts})"


def weights_gib(route: ModelRoute, role: str, base: Path) -> float | None:
    """The side's declared size, else the folder's *.safetensors where this machine has the side's folder."""
    declared = route.prefill_weights_gib if role == "prefill" else route.decode_weights_gib
    if declared is not None:
        return declared
    folder = resolve_model_path(route, base)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    # One path holds each machine's own format: a quantized MLX folder ("quantization", mlx-lm's key) is the decode
    # side's only; an unquantized or vLLM-quantized HF folder is measured for either side.
    if "quantization" in cfg and role == "prefill":
        return None
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) / GIB or None


def budgets(s: Settings, config: Path, errors: list[str], warnings: list[str]) -> list[Budget]:
    """One Budget per node that states memory_gib; errors for a machine over its RAM or disk."""
    base, out = config.resolve().parent, []
    for node in s.nodes:
        pool = "prefill" if node.role == "prefill" else "decode"
        routes = [m for m in s.models if node.name in getattr(m, pool)]
        if node.memory_gib is None:
            warnings.append(f"{node.name}: no memory_gib in its [[nodes]] entry, so its memory is not budgeted")
            continue
        sizes = {m.id: weights_gib(m, node.role, base) for m in routes}
        unknown = [mid for mid, g in sizes.items() if g is None]
        if unknown:
            warnings.append(f"{node.name}: weight size of {unknown} unknown here: set {pool}_weights_gib in [[models]]")
        known = [(f"{mid} weights", g) for mid, g in sizes.items() if g is not None]
        if node.role == "decode":
            b = _decode(s, node, routes, known, errors)
        else:
            b = _prefill(s, node, routes, sizes, errors)
        b.disk, b.disk_gib = [(what.replace(" weights", ""), g) for what, g in known], node.disk_gib
        _check_disk(b, errors)
        out.append(b)
    return out


def _decode(s: Settings, node: NodeConfig, routes: list[ModelRoute], weights: list, errors: list[str]) -> Budget:
    """Mac: every served model's MLX weights, a prefix cache per model, the in-flight KV bound and the pool."""
    mem = [*weights, (f"prefix caches ({len(routes)} models)", len(routes) * s.decode.prefix_cache_bytes / GIB),
           ("in-flight KV", s.kv.max_inflight_bytes / GIB), ("receive pool", s.kv.pool_bytes / GIB)]
    avail = node.memory_gib - node.reserved("decode")
    b = Budget(node.name, mem, avail, [], None)
    need = sum(g for _, g in mem)
    if need > avail:
        errors.append(f"decode node {node.name!r} needs {need:.1f} GiB ({', '.join(f'{w} {g:.1f}' for w, g in mem)}) "
                      f"but has {avail:.1f} GiB ({node.memory_gib:g} GiB less {node.reserved('decode'):g} reserved "
                      f"for macOS); lower [decode] prefix_cache_bytes, [kv] max_inflight_bytes or pool_bytes, serve "
                      f"fewer models on it, or give it more memory")
    return b


def _prefill(s: Settings, node: NodeConfig, routes: list[ModelRoute], sizes: dict, errors: list[str]) -> Budget:
    """Spark: vLLM asks for gpu_memory_utilization x total per engine and refuses to start when that exceeds what
    is free at start-up; each engine's share must hold its weights."""
    util, total = s.prefill.gpu_memory_utilization, node.memory_gib
    free = total - node.reserved("prefill")
    mem = [(f"vLLM {r.id}", util * total) for r in routes]
    b = Budget(node.name, mem, free, [], None)
    asked = util * total * len(routes)
    if asked > free:
        fit = int(free / total / max(len(routes), 1) * 100) / 100
        errors.append(f"prefill node {node.name!r}: vLLM asks for gpu_memory_utilization {util} x {total:g} GiB"
                      f"{f' x {len(routes)} engines' if len(routes) > 1 else ''} = {asked:.1f} GiB, but about "
                      f"{free:.1f} GiB is free at start ({total:g} less {node.reserved('prefill'):g} the OS and page "
                      f"cache keep): vLLM refuses to start; set [prefill] gpu_memory_utilization <= {fit}")
    for r in routes:
        w = sizes.get(r.id)
        if w is not None and w >= util * total:
            errors.append(f"prefill node {node.name!r}: {r.id} weights {w:.1f} GiB do not fit its vLLM share of "
                          f"{util * total:.1f} GiB (no room for KV blocks); raise gpu_memory_utilization or use a "
                          f"smaller checkpoint")
    return b


def _check_disk(b: Budget, errors: list[str]) -> None:
    need = sum(g for _, g in b.disk)
    if b.disk_gib is not None and need > b.disk_gib:
        errors.append(f"node {b.node!r}: its model folders take {need:.1f} GiB "
                      f"({', '.join(f'{w} {g:.1f}' for w, g in b.disk)}) but disk_gib is {b.disk_gib:g}; free disk "
                      f"or move [[models]] path to a larger volume")
