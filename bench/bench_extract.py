"""Extraction cost per step, at the site's shapes, on this machine's CPU: one gather per request and layer (before:
the connector's former per-request path, copied below as `per_request`) vs one gather per layer for all of a step's
requests (after: `Extractor.extract_batch`). Both in the same run, interleaved; the ratio is before / after.

Run from the repository root:  .venv/bin/python -m bench.bench_extract [--reps 5] [--requests 32] [--tokens 64]
Shapes (per rank, bf16, dense CUDA layout [blocks, H, 16, 2D] on CPU tensors): Qwen3-Coder-30B-A3B 48 layers x 4 KV
heads x 128; gpt-oss-120b 36 layers x 8 KV heads x 64. A step: `requests` requests of `tokens` new tokens each.
With a GPU it also times the CUDA path (pinned buffer reused, side-stream copy, event): ms per step, us per call,
GB/s and the pinned bytes it holds. None has been measured on a GPU by this project yet.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kv_bridge.vllm.extract import Extractor, Span
from kv_bridge.vllm.layouts import DenseLayout

SHAPES = {"qwen3-coder-30b-a3b": (48, 4, 128), "gpt-oss-120b": (36, 8, 64)}
BS = 16


def make_step(heads: int, dim: int, requests: int, tokens: int, context: int, device: str = "cpu"):
    """One layer's paged cache and the step's spans: each request's new tokens [context, context + tokens)."""
    per = (context + tokens + BS - 1) // BS
    cache = torch.randn(requests * per + 1, heads, BS, 2 * dim, device=device).to(torch.bfloat16)
    perm = torch.randperm(requests * per).tolist()  # pages scattered over the pool, as after a while of serving
    spans = [Span(perm[r * per:(r + 1) * per], context, context + tokens) for r in range(requests)]
    return cache, spans


def per_request(layout, kv_layer: torch.Tensor, s: Span):
    """The former Extractor.extract on the CPU (git a20e9c6): gather the request's blocks, split, copy K and V."""
    blocks, off = layout.block_span(s.block_ids, s.start, s.end)
    k, v = layout.split(kv_layer[torch.from_numpy(blocks)], off, s.end - s.start)
    k, v = k.contiguous(), v.contiguous()
    return k.view(torch.int16).numpy(), v.view(torch.int16).numpy(), torch.ones(2).numpy()


def run(name: str, layers: int, heads: int, dim: int, args) -> None:
    ex = Extractor(DenseLayout(BS, heads, dim), "bfloat16", False, torch.device("cpu"))
    cache, spans = make_step(heads, dim, args.requests, args.tokens, args.context)

    def before():
        for _ in range(layers):
            for s in spans:
                per_request(ex.layout, cache, s)

    def after():
        for _ in range(layers):
            ex.extract_batch(cache, spans, (1.0, 1.0))

    before(), after()  # warm-up
    tb, ta = [], []
    for _ in range(args.reps):
        for fn, out in ((before, tb), (after, ta)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    mb, ma = statistics.median(tb), statistics.median(ta)
    nbytes = layers * args.requests * args.tokens * heads * dim * 2 * 2
    print(f"{name:22s} {layers * len(spans):6d} -> {layers:3d} calls  before {mb * 1e3:8.2f} ms "
          f"({mb / (layers * len(spans)) * 1e6:6.1f} us/call)  after {ma * 1e3:8.2f} ms "
          f"({ma / layers * 1e6:7.1f} us/call)  {nbytes / ma / 1e9:5.2f} GB/s  ratio {mb / ma:5.2f}x")


def run_cuda(name: str, layers: int, heads: int, dim: int, args) -> None:
    """The GPU path (pinned buffer, side stream, event): a step's extraction of every layer, then every ready()."""
    ex = Extractor(DenseLayout(BS, heads, dim), "bfloat16", False, torch.device("cuda"))
    cache, spans = make_step(heads, dim, args.requests, args.tokens, args.context, "cuda")

    def step():
        batches = [ex.extract_batch(cache, spans, (1.0, 1.0)) for _ in range(layers)]
        for b in batches:
            b.parts[0].ready()
            for _ in b.parts:
                b.release()

    step()
    times = []
    for _ in range(args.reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    m = statistics.median(times)
    nbytes = layers * args.requests * args.tokens * heads * dim * 2 * 2
    pinned = sum(b.numel() for b in ex.pinned._free)
    print(f"{name:22s} cuda  {layers:3d} calls  {m * 1e3:8.2f} ms/step  {m / layers * 1e6:7.1f} us/call  "
          f"{nbytes / m / 1e9:6.2f} GB/s  pinned {pinned / 2**20:.1f} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request in the step")
    p.add_argument("--context", type=int, default=512, help="tokens each request already has")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared box)")
    p.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = p.parse_args()
    if args.smoke:
        args.reps, args.requests, args.tokens, args.context = 1, 2, 16, 64
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.requests} requests x {args.tokens} "
          f"tokens per step, bf16, median of {args.reps}; ratio = before / after")
    for name, (layers, heads, dim) in SHAPES.items():
        run(name, layers, heads, dim, args)
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()}")
        for name, (layers, heads, dim) in SHAPES.items():
            run_cuda(name, layers, heads, dim, args)
    else:
        print("no CUDA GPU here: the CUDA path was not timed (tests/bench/test_smoke.py runs it where there is one)")


if __name__ == "__main__":
    main()
