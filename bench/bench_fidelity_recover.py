"""How long a decode node's pair stays off the split after a kill -9 under load (issue #50): on the one-machine site
(`make site`, examples/site-local.toml), a burst of long prompts prefilling on the Mac itself (its /v1/generate
without KV, the load a pending pair puts on it), then kill -9 of that Mac's process; `disagg up` restarts it. From
the kill: seconds until the gateway sees it up, until its (model, Spark, Mac) pair carries KV again (/health
`usable`) and until the canary verifies it. Optionally the same on a baseline tree first (an export of main), same
run, and the ratio.

Run from the repository root, under the heavy lock (the site's fixed ports):
    flock /tmp/disagg-heavy.lock nice -n 10 .venv/bin/python -m bench.bench_fidelity_recover [--baseline DIR]
        [--node mac-0] [--model smollm2:135m] [--workers 3] [--prompt-tokens 1500] [--max-s 300] [--json F]
    --smoke: one worker, 300-token prompts, 120 s at most, no baseline (a quick check that it runs).
Each tree's site is started (`python -m backends.site.launch` with that tree's code and state folder) and stopped;
--running measures a `make site` already up instead (this tree's; no baseline), and leaves it up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CONFIG = Path("examples/site-local.toml")
GATEWAY = "http://127.0.0.1:8000"


class Site:
    """`python -m backends.site.launch` run from `tree` with its own code; SIGINT stops it."""

    def __init__(self, tree: Path, log: Path):
        self.tree, self.log = tree, log
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
        env.pop("DISAGG_CONFIG", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "backends.site.launch", "--config", str(CONFIG)],
                                     cwd=tree, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.wait_output("disagg up: ready", 1200)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_output(self, text: str, timeout: float) -> None:
        t0 = time.monotonic()
        while text not in self.output():
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"no {text!r} from the site:\n{self.output()[-3000:]}")
            time.sleep(1.0)

    def pid(self, name: str) -> int:
        return int(re.findall(rf"(?:started|restarted) {re.escape(name)} \(pid (\d+)\)", self.output())[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class RunningSite:
    """A site already up (`make site` in another shell): its roles found by their command lines; left running."""

    def pid(self, name: str) -> int:
        import psutil

        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "backends.cli.main" in cmd and "--node" in cmd[:-1] and cmd[cmd.index("--node") + 1] == name:
                return p.pid
        raise RuntimeError(f"no process of {name} (`disagg ... --node {name}`): is the site up (make site)?")

    def stop(self) -> None:
        pass


def settings_of(tree: Path):
    """The tree's site settings (its node secret: each tree's site writes its own)."""
    from kv_bridge.config.settings import load_config

    return load_config(tree / CONFIG)


def burst(url: str, token: str, model: str, tokens: int, stop: threading.Event, done: list) -> None:
    """One worker: long prompts the Mac prefills itself, one after another, until `stop` (its restart included)."""
    rng = random.Random()
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=5.0)) as http:
        while not stop.is_set():
            body = {"model": model, "token_ids": [rng.randrange(200, 40000) for _ in range(tokens)],
                    "max_tokens": 4, "temperature": 0.0}
            try:
                with http.stream("POST", url + "/v1/generate", json=body,
                                 headers={"Authorization": f"Bearer {token}"}) as r:
                    for _ in r.iter_lines():
                        pass
                done.append(time.monotonic())
            except httpx.HTTPError:
                time.sleep(0.5)  # the Mac is down: try again as a client would


def pair_row(http: httpx.Client, model: str, node: str) -> tuple[dict | None, dict | None]:
    """(the Mac's node row, its pair's fidelity row) from the gateway's /health; (None, None) when it is silent."""
    try:
        body = http.get(GATEWAY + "/health").json()
    except (httpx.HTTPError, ValueError):
        return None, None
    n = next((x for x in body.get("nodes", []) if x["name"] == node), None)
    row = next((r for r in body.get("fidelity", []) if r["model"] == model and r["decode"] == node), None)
    return n, row


def measure(tree: Path, args, log: Path) -> dict:
    """One tree: its site up and verified, the burst on, kill -9 the Mac, seconds to up / carries KV / verified."""
    site = RunningSite() if args.running else Site(tree, log)
    try:
        s = settings_of(tree)
        mac, token = s.node(args.node), s.auth.node_token()
        http = httpx.Client(timeout=5.0)
        t0 = time.monotonic()
        asked = -1e9
        while (pair_row(http, args.model, args.node)[1] or {}).get("state") != "verified":
            if time.monotonic() - t0 > args.max_s:
                raise RuntimeError("the pair never verified before the kill")
            if args.running and time.monotonic() - asked > 20:
                # A site others used (killed nodes, cut links) may hold its pair (a real-traffic demotion waits for
                # an operator): re-check it as an operator would, with the node token (POST /fidelity; 429: too soon)
                asked = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    http.post(f"{GATEWAY}/fidelity", params={"model": args.model},
                              headers={"Authorization": f"Bearer {token}"}, timeout=args.max_s)
            time.sleep(0.5)
        stop, done = threading.Event(), []
        workers = [threading.Thread(target=burst, args=(mac.url, token, args.model, args.prompt_tokens, stop, done),
                                    daemon=True) for _ in range(args.workers)]
        for w in workers:
            w.start()
        time.sleep(args.warm_s)  # the Mac busy with the burst's prefills
        os.killpg(site.pid(args.node), signal.SIGKILL)
        kill, marks, row = time.monotonic(), {}, None
        while time.monotonic() - kill < args.max_s and "verified" not in marks:
            n, row = pair_row(http, args.model, args.node)
            now = time.monotonic() - kill
            if n is not None and not n["up"]:
                marks.setdefault("seen_down", now)
            if "seen_down" in marks and n is not None and n["up"]:
                marks.setdefault("up", now)
            if "up" in marks and row is not None and row["usable"]:
                marks.setdefault("carries_kv", now)
            if "up" in marks and row is not None and row["state"] == "verified" and not row.get("stale"):
                marks.setdefault("verified", now)
            time.sleep(0.25)
        stop.set()
        return {"tree": str(tree), "marks": marks, "max_s": args.max_s, "state": row and row["state"],
                "summary": row and row.get("summary"), "burst_done": len(done)}
    finally:
        site.stop()


def fmt(marks: dict, key: str, cap: float) -> str:
    return f"{marks[key]:.1f}" if key in marks else f">{cap:.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, help="another source tree (e.g. `git archive main`), measured first")
    p.add_argument("--node", default="mac-0")
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--warm-s", type=float, default=10.0, help="burst seconds before the kill")
    p.add_argument("--max-s", type=float, default=300.0, help="give up this long after the kill")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--running", action="store_true", help="measure the site already up (make site); no baseline")
    p.add_argument("--json")
    args = p.parse_args()
    if args.smoke:
        args.workers, args.prompt_tokens, args.max_s, args.warm_s, args.baseline = 1, 300, 120.0, 3.0, None
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-fidelity-recover-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    if args.running:
        args.baseline = None
    for name, tree in (("baseline", args.baseline), ("this tree", ROOT)):
        if tree is None:
            continue
        runs.append({"name": name, **measure(tree.resolve(), args, logs / f"{name.replace(' ', '-')}.log")})
        print(json.dumps(runs[-1]), flush=True)
    print(f"\nkill -9 {args.node} under {args.workers} x {args.prompt_tokens}-token local prefills; seconds after "
          f"the kill (site logs in {logs}):")
    print(f"{'run':<10} {'back up':>8} {'carries KV':>11} {'verified':>9}  state")
    for r in runs:
        m = r["marks"]
        print(f"{r['name']:<10} {fmt(m, 'up', r['max_s']):>8} {fmt(m, 'carries_kv', r['max_s']):>11} "
              f"{fmt(m, 'verified', r['max_s']):>9}  {r['state']}")
    if len(runs) == 2:  # the restart itself (loading the models) is the same work in both: what follows it differs
        after = [("" if "carries_kv" in r["marks"] else ">") +
                 f"{r['marks'].get('carries_kv', r['max_s']) - r['marks'].get('up', 0):.1f}s" for r in runs]
        print(f"carries KV after it is back up: baseline {after[0]}, this tree {after[1]}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
