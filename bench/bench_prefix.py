"""Prefix reuse: a multi-turn conversation through the real stack with the decode node's prefix store on and off.

Run from the repository root:  .venv/bin/python -m bench.bench_prefix [--turns 10] [--turn-tokens 320] [--max-tokens 32]
Starts its own stack (decode-0, prefill-0, gateway) on free ports. Each condition runs the same conversation
(greedy; each turn appends the answer and ~turn-tokens of new user text, growing to ~4k tokens); between them only the
decode and prefill nodes restart (fresh caches), the decode node with decode.prefix_cache_bytes 0 ("full") or 1 GiB
("reuse"). vLLM's own prefix cache is on in both, so it helps each alike. Per turn: KV bytes moved (gateway
disagg_kv_transfer_bytes_total), reused tokens (disagg_prefix_tokens_total) and client-side TTFT; totals and ratios.
--config F: the prefill node is a running stack's (on this machine, its node secret), not restarted between the
conditions (its vLLM prefix cache is warm for the second: compare KV bytes, not TTFT); decode-0 and the gateway are
the bench's own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_split import TIMEOUT, filler
from bench.site_target import running_prefill
from tests.support.stack import MODEL_DIR, MODEL_ID, Stack

CONDITIONS = {"full": 0, "reuse": 1 << 30}  # decode.prefix_cache_bytes


def counter(client: httpx.Client, stack: Stack, name: str) -> float:
    text = client.get(stack.url("gateway") + "/metrics").text
    m = re.search(rf'^{name}\{{model="{re.escape(MODEL_ID)}"\}}\s+(\S+)', text, re.M)
    return float(m.group(1)) if m else 0.0


def turn(client: httpx.Client, stack: Stack, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy turn: TTFT, answer text, prompt tokens, and the KV bytes / reused tokens it caused."""
    bytes0 = counter(client, stack, "disagg_kv_transfer_bytes_total")
    prefix0 = counter(client, stack, "disagg_prefix_tokens_total")
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, t_first, text, usage = time.perf_counter(), None, [], None
    with client.stream("POST", stack.url("gateway") + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                if (c.get("delta") or {}).get("content"):
                    t_first = t_first or time.perf_counter()
                    text.append(c["delta"]["content"])
    if t_first is None or usage is None:
        raise RuntimeError("stream ended without content or usage")
    return {"ttft": t_first - t0, "text": "".join(text), "prompt": usage["prompt_tokens"],
            "bytes": counter(client, stack, "disagg_kv_transfer_bytes_total") - bytes0,
            "prefix": counter(client, stack, "disagg_prefix_tokens_total") - prefix0}


def conversation(client: httpx.Client, stack: Stack, tag: str, turns: int, turn_words: int, max_tokens: int,
                 label: str) -> list[dict]:
    messages = [{"role": "system", "content": f"Session {tag}. You are a careful assistant."}]
    words = filler(turn_words * turns).split(" ")
    rows = []
    for i in range(turns):
        body = " ".join(words[i * turn_words:(i + 1) * turn_words])  # new text every turn
        messages.append({"role": "user", "content": f"Part {i + 1}: {body}\n\nWhat is part {i + 1} about?"})
        r = turn(client, stack, messages, max_tokens)
        messages.append({"role": "assistant", "content": r["text"]})
        rows.append(r)
        print(f"{label:<6} turn {i + 1:>2}: prompt {r['prompt']:>5}  reused {r['prefix']:>5.0f}  "
              f"KV MB {r['bytes'] / 1e6:8.2f}  TTFT s {r['ttft']:6.3f}", flush=True)
    return rows


def restart_nodes(stack: Stack, client: httpx.Client, prefix_bytes: int, own_prefill: bool = True) -> None:
    """Fresh nodes (no cache from the other condition on either side), the decode node with the given prefix
    store size; wait until the gateway routes to them again."""
    names = ("decode-0", "prefill-0") if own_prefill else ("decode-0",)
    for name in names:
        stack.kill(name)
    stack.start("decode-0", env={"DISAGG_DECODE__PREFIX_CACHE_BYTES": str(prefix_bytes)})
    if own_prefill:
        stack.start("prefill-0")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if client.get(stack.url("gateway") + "/health").status_code == 200:
            return
        time.sleep(0.5)
    raise RuntimeError("gateway did not see decode-0 healthy again")


def report(results: dict[str, list[dict]]) -> None:
    full, reuse = results["full"], results["reuse"]
    print(f"\nmachine: nproc {len(os.sched_getaffinity(0))} (shared with other work: timings are noisy)")
    print(f"{'turn':>4}{'prompt':>8}{'reused':>8}{'MB full':>10}{'MB reuse':>10}{'bytes x':>9}"
          f"{'TTFT full':>11}{'TTFT reuse':>12}{'TTFT x':>8}{'same answer':>13}")
    for i, (f, r) in enumerate(zip(full, reuse)):
        ratio = f["bytes"] / r["bytes"] if r["bytes"] else float("inf")
        print(f"{i + 1:>4}{r['prompt']:>8}{r['prefix']:>8.0f}{f['bytes'] / 1e6:>10.2f}{r['bytes'] / 1e6:>10.2f}"
              f"{ratio:>9.1f}{f['ttft']:>11.3f}{r['ttft']:>12.3f}{f['ttft'] / r['ttft']:>8.2f}"
              f"{str(f['text'] == r['text']):>13}")
    fb, rb = sum(x["bytes"] for x in full), sum(x["bytes"] for x in reuse)
    ft, rt = sum(x["ttft"] for x in full), sum(x["ttft"] for x in reuse)
    later_f, later_r = sum(x["ttft"] for x in full[1:]), sum(x["ttft"] for x in reuse[1:])
    print(f"\ntotals: KV moved full {fb / 1e6:.1f} MB, reuse {rb / 1e6:.1f} MB -> {fb / max(rb, 1):.1f}x fewer bytes "
          f"({100 * rb / max(fb, 1):.1f}% of full)")
    print(f"        TTFT sum full {ft:.2f} s, reuse {rt:.2f} s -> {ft / rt:.2f}x; turns 2+ only: "
          f"{later_f:.2f} s vs {later_r:.2f} s -> {later_f / later_r:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-tokens", type=int, default=320, help="about this many new user tokens per turn")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    ap.add_argument("--config", type=Path, help="use this running stack's prefill node (this machine) instead of "
                    "starting one")
    args = ap.parse_args()
    if args.smoke:
        args.turns, args.turn_tokens, args.max_tokens = 2, 32, 4

    folder = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    port, secret = running_prefill(args.config, MODEL_ID) if args.config else (None, None)
    # over a running prefill node, no KV canary (its subject is elsewhere, as in bench_class_spec: one canary less
    # per decode start); on its own stack, the product's default
    stack = Stack(folder, kv_timeout_s=300.0, min_disagg_tokens=8, prefix_cache_bytes=CONDITIONS["full"],
                  prefill_port=port, node_secret=secret, fidelity=args.config is None)
    words = int(args.turn_tokens / 1.08)  # the filler runs about 1.08 tokens a word
    results = {}
    try:
        stack.start_all(["decode-0", "gateway"] if args.config else ["decode-0", "prefill-0", "gateway"])
        with httpx.Client(timeout=TIMEOUT) as client:
            turn(client, stack, [{"role": "user", "content": "Say hello."}], 4)  # warm-up, unmeasured
            for label, prefix_bytes in CONDITIONS.items():
                if prefix_bytes != CONDITIONS["full"]:
                    restart_nodes(stack, client, prefix_bytes, own_prefill=args.config is None)
                    turn(client, stack, [{"role": "user", "content": "Say hello."}], 4)
                results[label] = conversation(client, stack, "1", args.turns, words, args.max_tokens, label)
        report(results)
    except BaseException:
        print(f"bench failed; node logs in {folder}", file=sys.stderr)
        raise
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
