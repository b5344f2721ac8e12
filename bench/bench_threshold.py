"""Where disaggregation starts to pay: time-to-first-token of the local path (decode node prefills itself) against
the disaggregated path (vLLM prefills, KV streams to decode), per prompt length, and the break-even length.

Run from the repository root:  .venv/bin/python -m bench.bench_threshold [--runs 5] [--sizes 8,16,32,64,128]
Starts its own stack (decode-0, prefill-0, a gateway with min_disagg_tokens=1) plus a second gateway on the same
nodes whose threshold is out of reach (every request local). Prompts are raw token ids sent to /v1/completions, so a
size is exact (no chat template around it); every request gets a fresh leading token run so no cache helps either
side. TTFT is request start to the first SSE event, measured at the client, through a gateway on both paths.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.stack import MODEL_DIR, MODEL_ID, Stack, free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = httpx.Timeout(600.0, connect=10.0)
WORDS = ("river stone lantern orchard copper meadow signal harbor violet engine summit ledger canyon "
         "whistle marble forest cipher beacon thunder garden ribbon falcon glacier pepper").split()
NEVER = 1_000_000  # a min_disagg_tokens no prompt reaches: that gateway always takes the local path


class Prompts:
    """Token-id prompts of an exact length; `tag` leads the text so no two requests share a prefix."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))

    def ids(self, n: int, tag: int) -> list[int]:
        words = [WORDS[(i * 7 + tag) % len(WORDS)] for i in range(n + 8)]
        text = f"Note {tag}: " + " ".join(words)
        ids = self.tok.encode(text, add_special_tokens=False).ids
        assert len(ids) >= n, (len(ids), n)
        return ids[:n]


def ttft(client: httpx.Client, url: str, ids: list[int], expect_path: str) -> float:
    body = {"model": MODEL_ID, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as r:
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


def start_local_gateway(stack: Stack, folder: Path) -> tuple[subprocess.Popen, str]:
    """A second gateway on the same nodes whose threshold no prompt reaches."""
    port = free_port()
    text = stack.config.read_text()
    text = re.sub(r"(?m)^port = \d+", f"port = {port}", text, count=1)  # the first port is [gateway]'s
    text = re.sub(r"(?m)^min_disagg_tokens = \d+", f"min_disagg_tokens = {NEVER}", text)
    cfg = folder / "config-local.toml"
    cfg.write_text(text)
    log = open(folder / "gateway-local.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "backends.cli.main", "gateway", "--config", str(cfg)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 120, proc)
    return proc, url


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", default="8,16,32,64,128")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    prompts = Prompts()

    folder = Path(tempfile.mkdtemp(prefix="bench-threshold-"))
    stack = Stack(folder, kv_timeout_s=120.0, min_disagg_tokens=1)
    local_proc = None
    print(f"starting stack (logs in {folder}) ...", flush=True)
    try:
        for name in ("decode-0", "prefill-0", "gateway"):
            stack.start(name)
        local_proc, local_url = start_local_gateway(stack, folder)
        paths = {"local": local_url, "disaggregated": stack.url("gateway")}
        results: dict[int, dict[str, list[float]]] = {n: {p: [] for p in paths} for n in sizes}
        with httpx.Client(timeout=TIMEOUT) as client:
            for path, url in paths.items():  # first-request compilation and allocation land on no measured run
                for n in (min(sizes), max(sizes)):
                    ttft(client, url, prompts.ids(n, 9000 + n), path)
            tag = 0
            for run in range(args.runs):
                for n in sizes:
                    order = list(paths) if (run + n) % 2 == 0 else list(paths)[::-1]  # alternate who goes first
                    for path in order:
                        tag += 1
                        results[n][path].append(ttft(client, paths[path], prompts.ids(n, tag), path))
                print(f"run {run + 1}/{args.runs}: " + "  ".join(
                    f"{n}: {results[n]['local'][-1] * 1000:.0f}/{results[n]['disaggregated'][-1] * 1000:.0f} ms"
                    for n in sizes), flush=True)
        report(results, args.runs)
    except BaseException:
        print(f"bench failed; logs in {folder}", file=sys.stderr)
        raise
    finally:
        if local_proc is not None:
            os.killpg(local_proc.pid, 15)
            local_proc.wait(timeout=20)
        stack.stop()


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
