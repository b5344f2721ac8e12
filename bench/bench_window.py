"""Bytes that cross for a gpt-oss-120b-shaped prompt: every token of every layer (before) vs only the window on
sliding layers (after: what mlx-lm's RotatingKVCache keeps). Both from the connector's real worker half, in the
same run, over a real paged cache; the ratio is before / after.

Run from the repository root:  .venv/bin/python -m bench.bench_window [--tokens 16384] [--chunk 2048]
gpt-oss-120b per layer: 8 KV heads x 64, bf16, window 128, sliding and full layers alternating (18 + 18 of 36).
Two layers (one of each kind) are extracted for real; the total is that pair's bytes times 18.
"""

from __future__ import annotations

import argparse

import torch

from kv_bridge.vllm.extract import Extractor
from kv_bridge.vllm.layouts import DenseLayout
from kv_bridge.vllm.scheduler import DisaggConnectorMetadata, SendSpec
from kv_bridge.vllm.worker import WorkerSide

H, D, BS, WINDOW, PAIRS = 8, 64, 16, 128, 18
SPEC = {"fingerprint": "bench", "num_layers": 2, "num_kv_heads": H, "head_dim": D}
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]  # 0 slides, 1 is full


class CountingSender:
    """The sender's interface; counts the payload bytes that would cross."""

    def __init__(self):
        self.bytes = 0

    def open(self, hdr, host, port) -> None:
        return

    def send_layer(self, tid, layer, start, keys, values, scales=None, ready=None, release=None) -> None:
        self.bytes += keys.nbytes + values.nbytes
        if release is not None:
            release()

    def close(self, tid, error=None) -> None:
        return

    def shutdown(self) -> None:
        return


def crossed(tokens: int, chunk: int, window: tuple[int, tuple[int, ...]]) -> int:
    blocks = list(range((tokens + BS - 1) // BS))
    cache = torch.randn(len(blocks), H, BS, 2 * D).to(torch.bfloat16)
    w = WorkerSide(None, None, {})
    w.configure(Extractor(DenseLayout(BS, H, D), "bfloat16", False, torch.device("cpu")), SPEC,
                {name: (i, None) for i, name in enumerate(NAMES)}, (0, H), window)
    w.sender.shutdown()
    w.sender = counter = CountingSender()
    for a in range(0, tokens, chunk):  # chunked prefill: one step per chunk, every layer per step
        b = min(a + chunk, tokens)
        meta = DisaggConnectorMetadata(sends=[SendSpec("r", "t", "127.0.0.1", 1, blocks, a, b, tokens, a == 0)])
        for name in NAMES:
            w.save_kv_layer(meta, name, cache)
        w.wait_for_save(meta)
    return counter.bytes * PAIRS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.chunk = 512, 128
    before = crossed(args.tokens, args.chunk, (0, ()))
    after = crossed(args.tokens, args.chunk, (WINDOW, (0,)))
    print(f"gpt-oss-120b shape, {args.tokens} tokens in chunks of {args.chunk}, bf16 wire, window {WINDOW}")
    print(f"before (every token of every layer): {before / 2**20:9.1f} MiB")
    print(f"after  (sliding layers: window only): {after / 2**20:9.1f} MiB   ratio {before / after:.2f}x")


if __name__ == "__main__":
    main()
