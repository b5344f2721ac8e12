"""Split (vLLM prefill + MLX decode) against MLX alone and vLLM alone on a long prompt, ratios from the same run.

Run from the repository root:  .venv/bin/python -m bench.bench_split [--runs 3] [--max-tokens 64] [--prompt-tokens 1000]
Starts its own stack (decode-0, prefill-0, gateway) on free ports; greedy decoding; a fresh prompt per request.
On a running site, from the gateway's machine: `--config /opt/disagg/config.toml --model qwen3-coder:30b` measures
its gateway, the model's first decode node (MLX alone) and first prefill node (vLLM alone) (bench/site_target.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.site_target import Target, add_args, embedded, site

TIMEOUT = httpx.Timeout(900.0, connect=10.0)
WORDS = ("river stone lantern orchard copper meadow signal harbor violet engine summit ledger canyon "
         "whistle marble forest cipher beacon thunder garden ribbon falcon glacier pepper").split()


def filler(n_words: int) -> str:
    # Deterministic, non-repeating-looking text: varied word order so no tokenizer merges collapse it.
    out = []
    for i in range(n_words):
        out.append(WORDS[(i * 7 + i // len(WORDS)) % len(WORDS)])
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


class Prompts:
    """Templated chat prompts of about `target` tokens; `tag` leads the system message so no prefix is shared."""

    def __init__(self, tok, target: int, question: str = "\n\nSummarize the text above in detail, as a numbered list."):
        self.tok, self.question = tok, question
        words = max(1, target)
        for _ in range(8):  # a few fixed-point steps on the word count; lands within a few tokens
            self.body = filler(words)
            n = len(self.ids(1000))  # tags in the runs have 4 digits too
            if abs(n - target) <= 2:
                break
            words = max(1, words + (target - n) * words // max(n, 1))

    def messages(self, tag: int) -> list[dict]:
        return [{"role": "system", "content": f"Session {tag}. You are a careful assistant."},
                {"role": "user", "content": self.body + self.question}]

    def ids(self, tag: int) -> list[int]:
        text = self.tok.apply_chat_template(self.messages(tag), add_generation_prompt=True, tokenize=False)
        return self.tok.encode(text, add_special_tokens=False)


def decode_rate(n_tokens: int, t_first: float | None, t_last: float | None) -> float:
    if n_tokens < 2 or t_first is None or t_last is None or t_last <= t_first:
        return float("nan")
    return (n_tokens - 1) / (t_last - t_first)


def run_split(client: httpx.Client, target: Target, prompts: Prompts, tag: int, max_tokens: int) -> dict:
    body = {"model": target.model, "messages": prompts.messages(tag), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    t_first = t_last = None
    usage = None
    with client.stream("POST", target.url("gateway") + "/v1/chat/completions", json=body,
                       headers=target.headers("gateway")) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {r.read()[:500]!r}")
        path = r.headers.get("x-disagg-path")
        if path != "disaggregated":
            raise RuntimeError(f"split run took path {path!r}, not 'disaggregated'")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                t_last = time.perf_counter()
                t_first = t_first or t_last
    end = time.perf_counter()
    if usage is None or t_first is None:
        raise RuntimeError("split stream ended without content or usage")
    n = usage["completion_tokens"]
    return {"ttft": t_first - t0, "tps": decode_rate(n, t_first, t_last), "e2e": end - t0, "tokens": n,
            "prompt": usage["prompt_tokens"]}


def run_mlx(client: httpx.Client, target: Target, prompts: Prompts, tag: int, max_tokens: int) -> dict:
    ids = prompts.ids(tag)
    body = {"request_id": f"bench-mlx-{tag}-{time.time_ns()}", "model": target.model, "token_ids": ids,
            "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": [], "kv": None}
    t0 = time.perf_counter()
    t_first = t_last = None
    done = None
    with client.stream("POST", target.url("decode-0") + "/v1/generate", json=body,
                       headers=target.headers("decode-0")) as r:
        if r.status_code != 200:
            raise RuntimeError(f"decode node answered {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.strip():
                continue
            msg = json.loads(line)
            if msg["type"] == "token":
                t_last = time.perf_counter()
                t_first = t_first or t_last
            elif msg["type"] == "done":
                done = msg
            elif msg["type"] == "error":
                raise RuntimeError(f"decode node error: {msg['message']}")
    end = time.perf_counter()
    if done is None or t_first is None:
        raise RuntimeError("decode stream ended without tokens or done")
    n = done["completion_tokens"]
    return {"ttft": t_first - t0, "tps": decode_rate(n, t_first, t_last), "e2e": end - t0, "tokens": n,
            "prompt": done["prompt_tokens"]}


def run_vllm(client: httpx.Client, target: Target, prompts: Prompts, tag: int, max_tokens: int) -> dict:
    ids = prompts.ids(tag)
    body = {"model": target.model, "token_ids": ids, "max_tokens": max_tokens, "temperature": 0.0, "seed": None}
    t0 = time.perf_counter()
    r = client.post(target.url("prefill-0") + "/v1/generate", json=body, headers=target.headers("prefill-0"))
    end = time.perf_counter()
    if r.status_code != 200:
        raise RuntimeError(f"prefill node answered {r.status_code}: {r.text[:500]}")
    n = len(r.json()["token_ids"])
    return {"ttft": float("nan"), "tps": float("nan"), "e2e": end - t0, "tokens": n, "prompt": len(ids)}


def paths_from_metrics(client: httpx.Client, target: Target) -> dict[str, float]:
    text = client.get(target.url("gateway") + "/metrics", headers=target.headers("gateway")).text
    out: dict[str, float] = {}
    for m in re.finditer(r'^disagg_requests_total\{[^}]*path="(\w+)"[^}]*\}\s+(\S+)', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def fmt(x: float, spec: str) -> str:
    return "-" if x != x else format(x, spec)


def med(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r[key] == r[key]]  # drop NaN
    return statistics.median(vals) if vals else float("nan")


def report(results: dict[str, list[dict]], prompt_len: int, args: argparse.Namespace, target: Target) -> None:
    print(f"\nmeasured: {target.describe()}")
    print(f"this machine: nproc {len(os.sched_getaffinity(0))} (shared with other work: numbers are noisy); "
          f"prompt {prompt_len} tokens (templated chat), max_tokens {args.max_tokens}, greedy, "
          f"{args.runs} runs each, medians")
    print(f"{'mode':<12}{'TTFT s':>10}{'decode tok/s':>14}{'e2e s':>10}{'tokens':>8}{'e2e tok/s':>11}")
    for mode, rows in results.items():
        e2e_tps = med([{"x": r["tokens"] / r["e2e"]} for r in rows], "x")
        ttft, tps = fmt(med(rows, "ttft"), ".3f"), fmt(med(rows, "tps"), ".2f")
        print(f"{mode:<12}{ttft:>10}{tps:>14}{med(rows, 'e2e'):>10.3f}"
              f"{med(rows, 'tokens'):>8.0f}{e2e_tps:>11.2f}")
    s, m, v = results["split"], results["mlx-alone"], results["vllm-alone"]
    print("\nratios (split vs MLX alone, same run):")
    print(f"  TTFT speed-up        mlx_ttft / split_ttft = {med(m, 'ttft') / med(s, 'ttft'):.2f}x")
    print(f"  decode tok/s         split / mlx           = {med(s, 'tps') / med(m, 'tps'):.2f}x")
    print(f"  end-to-end speed-up  mlx_e2e / split_e2e   = {med(m, 'e2e') / med(s, 'e2e'):.2f}x")
    print(f"  (vLLM alone, e2e)    vllm_e2e / split_e2e  = {med(v, 'e2e') / med(s, 'e2e'):.2f}x")
    print("  per run (ttft s / e2e s):")
    for mode, rows in results.items():
        print(f"    {mode:<11} " + "  ".join(f"{fmt(r['ttft'], '.2f')}/{r['e2e']:.2f}" for r in rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    add_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.runs, args.max_tokens, args.prompt_tokens = 1, 4, 64
    if args.config is not None:
        return measure(site(args.config, args.model, args.gateway, args.api_key), args)
    # A long kv_timeout so a slow shared machine measures the split, not a fallback.
    folder = Path(tempfile.mkdtemp(prefix="bench-split-"))
    try:
        with embedded(folder, kv_timeout_s=300.0, min_disagg_tokens=8) as (target, _):
            measure(target, args)
    except BaseException:
        print(f"bench failed; node logs in {folder}", file=sys.stderr)
        raise


def measure(target: Target, args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target.tokenizer_dir))
    prompts = Prompts(tok, args.prompt_tokens)
    prompt_len = len(prompts.ids(1000))
    print(f"prompt: {prompt_len} tokens; measuring {target.describe()}", flush=True)
    runners = {"split": run_split, "mlx-alone": run_mlx, "vllm-alone": run_vllm}
    results: dict[str, list[dict]] = {k: [] for k in runners}
    with httpx.Client(timeout=TIMEOUT) as client:
        # Warm-up on a short, distinct prompt so first-request compilation costs land on no side.
        warm = Prompts(tok, max(40, target.min_disagg_tokens + 16), question="\n\nSay hello.")
        for fn in runners.values():
            fn(client, target, warm, -1, 4)
        before = paths_from_metrics(client, target)
        tag = 1000
        for i in range(args.runs):
            for mode, fn in runners.items():
                tag += 1  # a fresh leading number per request: no prefix cache helps any side
                r = fn(client, target, prompts, tag, args.max_tokens)
                results[mode].append(r)
                print(f"run {i + 1} {mode:<10} ttft_s {fmt(r['ttft'], '.3f'):>7}  e2e_s {r['e2e']:7.3f}  "
                      f"tokens {r['tokens']}  prompt {r['prompt']}", flush=True)
        after = paths_from_metrics(client, target)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    print(f"gateway paths during the measured runs: {delta}")
    report(results, prompt_len, args, target)


if __name__ == "__main__":
    main()
