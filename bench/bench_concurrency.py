"""Throughput and TTFT under concurrency: the split (gateway -> vLLM prefill -> MLX decode), MLX alone (decode node,
local prefill) and vLLM alone (prefill node's /v1/generate), each at 1, 4, 16 (and 64) requests at once.

Run from the repository root:  .venv/bin/python -m bench.bench_concurrency [--levels 1,4,16,64] [--prompt-tokens 256]
    [--max-tokens 32]
Starts its own stack on free ports (`--config F`: measures the running deployment F describes instead,
bench/site_target.py); greedy; every request has its own prompt (a fresh leading number), so no prefix is shared.
Per level and mode: c requests start together; throughput = completion tokens / wall time of the round, TTFT p50
over the round (vLLM alone answers in one piece: no TTFT). Modes alternate per level, so each sees the
same machine load; ratios are against MLX alone in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_split import Prompts
from bench.site_target import Target, add_args, embedded, site

TIMEOUT = httpx.Timeout(1800.0, connect=30.0)
LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=256)


async def split(client: httpx.AsyncClient, target: Target, prompts: Prompts, tag: int, max_tokens: int) -> dict:
    body = {"model": target.model, "messages": prompts.messages(tag), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, usage = time.perf_counter(), None, None
    async with client.stream("POST", target.url("gateway") + "/v1/chat/completions", json=body,
                             headers=target.headers("gateway")) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread())[:300]!r}")
        if r.headers.get("x-disagg-path") != "disaggregated":
            raise RuntimeError(f"split request took path {r.headers.get('x-disagg-path')!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
    return {"ttft": ttft, "tokens": usage["completion_tokens"]}


async def mlx(client: httpx.AsyncClient, target: Target, prompts: Prompts, tag: int, max_tokens: int) -> dict:
    body = {"request_id": f"bench-c-{tag}-{time.time_ns()}", "model": target.model, "token_ids": prompts.ids(tag),
            "max_tokens": max_tokens, "temperature": 0.0, "kv": None}
    t0, ttft, done = time.perf_counter(), None, None
    async with client.stream("POST", target.url("decode-0") + "/v1/generate", json=body,
                             headers=target.headers("decode-0")) as r:
        if r.status_code != 200:
            raise RuntimeError(f"decode node answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            msg = json.loads(line) if line.strip() else {}
            if msg.get("type") == "token" and ttft is None:
                ttft = time.perf_counter() - t0
            elif msg.get("type") == "done":
                done = msg
            elif msg.get("type") == "error":
                raise RuntimeError(f"decode node error: {msg['message']}")
    return {"ttft": ttft, "tokens": done["completion_tokens"]}


async def vllm(client: httpx.AsyncClient, target: Target, prompts: Prompts, tag: int, max_tokens: int) -> dict:
    body = {"model": target.model, "token_ids": prompts.ids(tag), "max_tokens": max_tokens, "temperature": 0.0}
    r = await client.post(target.url("prefill-0") + "/v1/generate", json=body, headers=target.headers("prefill-0"))
    if r.status_code != 200:
        raise RuntimeError(f"prefill node answered {r.status_code}: {r.text[:300]}")
    return {"ttft": None, "tokens": len(r.json()["token_ids"])}


MODES = {"split": split, "mlx-alone": mlx, "vllm-alone": vllm}


async def round_(client, target, fn, prompts: Prompts, first_tag: int, c: int, max_tokens: int) -> dict:
    """c requests at once: throughput over the round's wall time, TTFT p50."""
    t0 = time.perf_counter()
    rows = await asyncio.gather(*(fn(client, target, prompts, first_tag + i, max_tokens) for i in range(c)))
    wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in rows if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in rows)
    return {"tps": tokens / wall, "ttft_p50": statistics.median(ttfts) if ttfts else float("nan"), "wall": wall,
            "tokens": tokens}


def report(results: dict[int, dict[str, dict]], prompt_len: int, args) -> None:
    if set(args.modes) != set(MODES):
        return  # the per-round lines above are the result
    print(f"\nmachine: nproc {len(os.sched_getaffinity(0))} (shared with other work: numbers are noisy); prompt "
          f"{prompt_len} tokens, max_tokens {args.max_tokens}, greedy; one round per level and mode")
    print(f"{'conc':>5}  " + "".join(f"{m + ' tok/s':>18}{'TTFT p50 s':>12}" for m in MODES))
    for c, row in results.items():
        print(f"{c:>5}  " + "".join(f"{row[m]['tps']:>18.2f}{_f(row[m]['ttft_p50']):>12}" for m in MODES))
    print("\nratios (same run): throughput vs MLX alone, and each mode's scaling vs its own concurrency 1")
    base = results[min(results)]
    for c, row in results.items():
        vs = "  ".join(f"{m}/mlx {row[m]['tps'] / row['mlx-alone']['tps']:.2f}x" for m in ("split", "vllm-alone"))
        scale = "  ".join(f"{m} {row[m]['tps'] / base[m]['tps']:.2f}x" for m in MODES)
        print(f"  c={c:<3} {vs}   scaling: {scale}")


def _f(x: float) -> str:
    return "-" if x != x else f"{x:.3f}"


async def measure(target: Target, prompts: Prompts, warm: Prompts, args) -> dict[int, dict[str, dict]]:
    results, tag = {}, 1000
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=LIMITS) as client:
        modes = {m: MODES[m] for m in args.modes}
        for fn in modes.values():  # first-request costs (compilation, connections) land on no side
            await fn(client, target, warm, -1, 4)
        for c in args.levels:
            results[c] = {}
            for mode, fn in modes.items():
                r = await round_(client, target, fn, prompts, tag, c, args.max_tokens)
                tag += c  # fresh prompts for every request
                results[c][mode] = r
                print(f"c={c:<3} {mode:<11} {r['tokens']:>5} tokens in {r['wall']:7.2f} s: {r['tps']:7.2f} tok/s, "
                      f"TTFT p50 {_f(r['ttft_p50'])} s", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                    help="a subset of split,mlx-alone,vllm-alone (the ratios need mlx-alone)")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    add_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.levels, args.prompt_tokens, args.max_tokens = [1], 64, 4

    if args.config is not None:  # a running deployment (bench/site_target.py)
        return run(site(args.config, args.model, args.gateway, args.api_key), args)
    folder = Path(tempfile.mkdtemp(prefix="bench-concurrency-"))
    print("starting stack ...", flush=True)
    try:  # a long kv_timeout so a slow shared machine measures the split, not a fallback
        with embedded(folder, kv_timeout_s=600.0, min_disagg_tokens=8) as (target, _):
            run(target, args)
    except BaseException:
        print(f"bench failed; node logs in {folder}", file=sys.stderr)
        raise


def run(target: Target, args) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target.tokenizer_dir))
    prompts = Prompts(tok, args.prompt_tokens)
    warm = Prompts(tok, max(40, target.min_disagg_tokens + 16), question="\n\nSay hello.")  # long enough to split
    prompt_len = len(prompts.ids(1000))
    print(f"prompt: {prompt_len} tokens; measuring {target.describe()}", flush=True)
    report(asyncio.run(measure(target, prompts, warm, args)), prompt_len, args)

if __name__ == "__main__":
    main()
