"""Where disaggregation starts to pay: time-to-first-token of the local path (decode node prefills itself) against
the disaggregated path (vLLM prefills, KV streams to decode), per prompt length, and the break-even length.

Run from the repository root:  .venv/bin/python -m bench.bench_threshold [--runs 5] [--sizes 8,16,32,64,128]
Starts its own stack (decode-0, prefill-0, a gateway with min_disagg_tokens=1) plus a second gateway on the same
nodes whose threshold is out of reach (every request local). Prompts are raw token ids sent to /v1/completions, so a
size is exact (no chat template around it); every request gets a fresh leading token run so no cache helps either
side. TTFT is request start to the first SSE event, measured at the client, through a gateway on both paths.
On a running site, from the gateway's machine: `--config /opt/disagg/config.toml --model qwen3-coder:30b --sizes
128,256,512,1024,2048` starts both gateways here (loopback ports) in front of the site's nodes and measures those.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.site_target import Target, add_args, embedded, site, start_gateway

TIMEOUT = httpx.Timeout(600.0, connect=10.0)
WORDS = ("river stone lantern orchard copper meadow signal harbor violet engine summit ledger canyon "
         "whistle marble forest cipher beacon thunder garden ribbon falcon glacier pepper").split()
NEVER = 1_000_000  # a min_disagg_tokens no prompt reaches: that gateway always takes the local path


class Prompts:
    """Token-id prompts of an exact length; `tag` leads the text so no two requests share a prefix."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def ids(self, n: int, tag: int) -> list[int]:
        words = [WORDS[(i * 7 + tag) % len(WORDS)] for i in range(n + 8)]
        text = f"Note {tag}: " + " ".join(words)
        ids = self.tok.encode(text, add_special_tokens=False).ids
        assert len(ids) >= n, (len(ids), n)
        return ids[:n]


def ttft(client: httpx.Client, url: str, ids: list[int], expect_path: str, target: Target) -> float:
    body = {"model": target.model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, headers=target.headers("gateway")) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {r.read()[:500]!r}")
        path = r.headers.get("x-disagg-path")
        if path != expect_path:
            raise RuntimeError(f"expected path {expect_path!r}, the gateway took {path!r}")
        first = None
        for line in r.iter_lines():  # read to the end, so the next request starts on an idle decode node
            if line.startswith("data: "):
                first = first if first is not None else time.perf_counter() - t0
                if line != "data: [DONE]" and "error" in json.loads(line[len("data: "):]):
                    raise RuntimeError(f"stream error: {line}")
    if first is None:
        raise RuntimeError("stream ended without an event")
    return first


def break_even(rows: list[tuple[int, float, float]]) -> float | None:
    """The prompt length from which disaggregated TTFT stays at or below local TTFT, interpolated linearly between
    the two measured sizes that bracket the crossing; None when disaggregation never wins."""
    wins = [d <= lo for _, lo, d in rows]
    if not any(wins):
        return None
    first = max((i for i, w in enumerate(wins) if not w), default=-1) + 1  # after the last size where local won
    if first >= len(rows):
        return None
    if first == 0:
        return float(rows[0][0])
    (n0, lo0, d0), (n1, lo1, d1) = rows[first - 1], rows[first]
    gap0, gap1 = d0 - lo0, d1 - lo1  # > 0 at n0, <= 0 at n1
    return n0 + (n1 - n0) * gap0 / (gap0 - gap1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", default="8,16,32,64,128")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    add_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.runs, args.sizes = 1, "8,16"
    sizes = [int(s) for s in args.sizes.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="bench-threshold-"))
    print(f"logs in {folder}", flush=True)
    try:
        if args.config is not None:
            target = site(args.config, args.model, args.gateway, args.api_key)
            measure(target, args.config, folder, sizes, args.runs, both=True)
        else:
            with embedded(folder, kv_timeout_s=120.0, min_disagg_tokens=1) as (target, stack):
                measure(target, stack.config, folder, sizes, args.runs, both=False)
    except BaseException:
        print(f"bench failed; logs in {folder}", file=sys.stderr)
        raise


def measure(target: Target, config: Path, folder: Path, sizes: list[int], runs: int, both: bool) -> None:
    """`both`: start the disaggregated gateway here too (a site: its own gateway's threshold is its own); else the
    target's gateway already has min_disagg_tokens 1 (the embedded stack)."""
    procs = []
    try:
        local_proc, local_url = start_gateway(config, folder, NEVER, target.headers("gateway"))
        procs.append(local_proc)
        disagg_url = target.url("gateway")
        if both:  # its canary must verify each pair before it sends a prompt to prefill
            proc, disagg_url = start_gateway(config, folder, 1, target.headers("gateway"), fidelity_wait_s=600)
            procs.append(proc)
        print(f"measuring {target.describe()}: local path via {local_url}, disaggregated via {disagg_url}",
              flush=True)
        run_sizes(target, {"local": local_url, "disaggregated": disagg_url}, sizes, runs)
    finally:
        for p in procs:
            os.killpg(p.pid, 15)
            p.wait(timeout=20)


def run_sizes(target: Target, paths: dict[str, str], sizes: list[int], runs: int) -> None:
    prompts = Prompts(target.tokenizer_dir)
    results: dict[int, dict[str, list[float]]] = {n: {p: [] for p in paths} for n in sizes}
    with httpx.Client(timeout=TIMEOUT) as client:
        for path, url in paths.items():  # first-request compilation and allocation land on no measured run
            for n in (min(sizes), max(sizes)):
                ttft(client, url, prompts.ids(n, 9000 + n), path, target)
        tag = 0
        for run in range(runs):
            for n in sizes:
                order = list(paths) if (run + n) % 2 == 0 else list(paths)[::-1]  # alternate who goes first
                for path in order:
                    tag += 1
                    results[n][path].append(ttft(client, paths[path], prompts.ids(n, tag), path, target))
            print(f"run {run + 1}/{runs}: " + "  ".join(
                f"{n}: {results[n]['local'][-1] * 1000:.0f}/{results[n]['disaggregated'][-1] * 1000:.0f} ms"
                for n in sizes), flush=True)
    report(results, runs)


def report(results: dict[int, dict[str, list[float]]], runs: int) -> None:
    print(f"\nmachine: nproc {len(os.sched_getaffinity(0))}; TTFT medians of {runs} runs, through a gateway, "
          "max_tokens 1, greedy")
    print(f"{'prompt tokens':>13}{'local ms':>10}{'disagg ms':>11}{'local/disagg':>14}  faster")
    rows = []
    for n, by_path in results.items():
        lo, d = statistics.median(by_path["local"]) * 1000, statistics.median(by_path["disaggregated"]) * 1000
        rows.append((n, lo, d))
        print(f"{n:>13}{lo:>10.0f}{d:>11.0f}{lo / d:>13.2f}x  {'disaggregated' if d <= lo else 'local'}")
    be = break_even(rows)
    if be is None:
        print("break-even: disaggregation did not win at any measured size")
    elif be == rows[0][0]:
        print(f"break-even: at or below {be:.0f} prompt tokens (disaggregation already wins at the smallest size; "
              "measure smaller sizes with --sizes)")
    else:
        print(f"break-even: about {be:.0f} prompt tokens (disaggregated TTFT <= local from there on)")


if __name__ == "__main__":
    main()
