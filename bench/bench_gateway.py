"""Gateway overhead (issue #4): our gateway and the LiteLLM proxy, each in front of an instant fake backend,
against that backend called directly, in one run. Latency at concurrency 1 and requests/s at 64 clients.

Run from the repository root:  .venv/bin/python -m bench.bench_gateway [--requests 300] [--duration 8]
LiteLLM comes from a separate venv (its pins clash with vLLM's):  python3 -m venv .venv-bench &&
.venv-bench/bin/pip install 'litellm[proxy]'   (or pass --litellm PATH). Processes: fakes, gateway, LiteLLM, and
this load generator (aiohttp, uvloop) each on their own interpreter. Targets: RPS >= 3x LiteLLM's, added p50 <= 1/3.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from bench._fakes import MODEL_ID, TEXT

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": MODEL_ID, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0.0}
PATH = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Target:
    name: str
    url: str
    proc: subprocess.Popen | None = None  # whose CPU time is charged to it (None: the direct baseline)
    stats: dict = field(default_factory=dict)  # mode -> {"p50", "p99", "rps", "cpu_us", "errors"}


def gateway_config(folder: Path, port: int, decode_port: int) -> Path:
    """One fake decode node and no prefill node, so every request takes the local path."""
    path = folder / "config.toml"
    path.write_text(f"""gateway = {{ host = "127.0.0.1", port = {port}, request_timeout_s = 30.0 }}
nodes = [{{ name = "fake-decode", role = "decode", port = {decode_port}, kv_port = {free_port()} }}]
models = [{{ id = "{MODEL_ID}", path = "{ROOT / 'models' / 'smollm2-135m'}", decode = ["fake-decode"] }}]
""")
    return path


def litellm_config(folder: Path, openai_port: int) -> Path:
    cfg = {  # JSON is YAML; every logging / spend / telemetry feature off, no database
        "model_list": [{"model_name": MODEL_ID, "litellm_params": {
            "model": f"openai/{MODEL_ID}", "api_base": f"http://127.0.0.1:{openai_port}/v1", "api_key": "fake"}}],
        "litellm_settings": {"telemetry": False, "set_verbose": False, "json_logs": False, "drop_params": True,
                             "turn_off_message_logging": True, "success_callback": [], "failure_callback": [],
                             "callbacks": []},
        # No auth, like our gateway (its favourable case: a master key would add a check per request).
        "general_settings": {"dangerously_permit_weak_or_unset_master_key": True, "disable_spend_logs": True,
                             "disable_error_logs": True, "disable_adding_master_key_hash_to_db": True},
    }
    path = folder / "litellm.yaml"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen, log: Path, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{proc.args[:3]} exited with {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.3)
    sys.exit(f"{url} not ready after {timeout:.0f} s; log {log}:\n{log.read_text()[-3000:]}")


def parse_text(raw: bytes, stream: bool) -> str:
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"]
    assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
    events = [json.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: {")]
    return "".join((c["delta"].get("content") or "") for e in events for c in e.get("choices", []))


async def call(session: aiohttp.ClientSession, url: str, payload: bytes) -> tuple[int, bytes]:
    async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read()


def cpu_seconds(proc: subprocess.Popen | None) -> float:
    """User + system CPU of a process and its children (0 for the direct baseline)."""
    if proc is None:
        return 0.0
    p = psutil.Process(proc.pid)
    return sum(sum(q.cpu_times()[:2]) for q in [p, *p.children(recursive=True)])


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def payload_for(stream: bool) -> bytes:
    # Streams ask for usage (as OpenAI SDK users commonly do): the backend then reports it, so LiteLLM need not
    # count tokens itself, and every target sends the same events.
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {"stream": False}
    return json.dumps({**BODY, **extra}).encode()


async def latency(targets: list[Target], stream: bool, n: int, warm: int) -> dict[str, dict]:
    """Sequential requests, one target after another in turn, so a noisy neighbour's bursts hit all alike."""
    payload = payload_for(stream)
    sessions = {t.name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for t in targets}
    lat: dict[str, list[float]] = {t.name: [] for t in targets}
    errors = dict.fromkeys(lat, 0)
    try:
        for t in targets:
            for _ in range(warm):
                status, raw = await call(sessions[t.name], t.url + PATH, payload)
                text = parse_text(raw, stream) if status == 200 else raw[:300]
                if text != TEXT:
                    sys.exit(f"{t.name} ({'stream' if stream else 'json'}) answered {status} {text!r}, want {TEXT!r}")
        for _ in range(n):
            for t in targets:
                t0 = time.perf_counter()
                status, raw = await call(sessions[t.name], t.url + PATH, payload)
                lat[t.name].append(time.perf_counter() - t0)
                errors[t.name] += status != 200
    finally:
        for s in sessions.values():
            await s.close()
    return {k: {"p50": pct(v, 0.50) * 1e3, "p99": pct(v, 0.99) * 1e3, "errors": errors[k]} for k, v in lat.items()}


async def throughput(t: Target, stream: bool, clients: int, duration: float, warm: float) -> dict:
    payload = payload_for(stream)
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()
        t0, t1 = start + warm, start + warm + duration
        counts = {"ok": 0, "errors": 0}

        async def worker() -> None:
            while loop.time() < t1:
                try:
                    status, raw = await call(session, t.url + PATH, payload)
                    ok = status == 200 and (not stream or raw.endswith(b"[DONE]\n\n"))
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok = False
                if t0 <= loop.time() <= t1:  # completions inside the window, whenever they started
                    counts["ok" if ok else "errors"] += 1

        async def cpu_window() -> float:
            await asyncio.sleep(warm)
            c0 = cpu_seconds(t.proc)
            await asyncio.sleep(duration)
            return cpu_seconds(t.proc) - c0

        cpu, *_ = await asyncio.gather(cpu_window(), *(worker() for _ in range(clients)))
    rps = counts["ok"] / duration
    return {"rps": rps, "cpu_us": cpu / max(counts["ok"], 1) * 1e6 if t.proc else 0.0, "errors": counts["errors"]}


def report(targets: list[Target], args) -> None:
    base, ours, *lite = targets
    print(f"\n{'target':<10}{'mode':<8}{'p50 ms':>8}{'p99 ms':>8}{'+p50 ms':>9}{'+p99 ms':>9}"
          f"{'req/s@' + str(args.clients):>11}{'CPU us/req':>12}{'errors':>8}")
    for mode in ("json", "stream"):
        b = base.stats[mode]
        for t in targets:
            s = t.stats[mode]
            print(f"{t.name:<10}{mode:<8}{s['p50']:8.2f}{s['p99']:8.2f}{s['p50'] - b['p50']:9.2f}"
                  f"{s['p99'] - b['p99']:9.2f}{s['rps']:11.0f}{s['cpu_us']:12.0f}{s['errors']:8d}")
    if not lite:  # a smoke run without LiteLLM: what our gateway adds to the direct backend
        for mode in ("json", "stream"):
            b, o = base.stats[mode], ours.stats[mode]
            print(f"  {mode:<6}  added p50 ours {o['p50'] - b['p50']:.2f} ms   "
                  f"RPS ours/direct = {o['rps'] / b['rps']:.2f}x")
        return
    lite = lite[0]
    print("\nratios (same run; direct backend is the latency baseline)")
    met = True
    for mode in ("json", "stream"):
        b, o, l = base.stats[mode], ours.stats[mode], lite.stats[mode]
        rps = o["rps"] / l["rps"]
        add = (o["p50"] - b["p50"]) / (l["p50"] - b["p50"])
        add99 = (o["p99"] - b["p99"]) / (l["p99"] - b["p99"])
        cpu = o["cpu_us"] / l["cpu_us"]
        ok_rps, ok_add = rps >= 3.0, add <= 1 / 3
        met &= ok_rps and ok_add
        print(f"  {mode:<6}  RPS ours/LiteLLM = {rps:5.2f}x (target >= 3x: {'met' if ok_rps else 'MISSED'})   "
              f"added p50 ours/LiteLLM = {add:5.3f} (target <= 0.333: {'met' if ok_add else 'MISSED'})   "
              f"added p99 ratio = {add99:5.3f}   CPU/req ratio = {cpu:5.3f}")
    print(f"\nall targets {'met' if met else 'NOT met'}")


async def run(args, tmp: Path) -> None:
    dport, oport, gport, lport = (free_port() for _ in range(4))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    lenv = {**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False",
            "DISABLE_SCHEMA_UPDATE": "True", "NO_DOCS": "True"}
    for k in ("DATABASE_URL", "REDIS_HOST", "LITELLM_MASTER_KEY", "OPENAI_API_KEY"):
        lenv.pop(k, None)
    py = sys.executable
    procs = {
        "fakes": spawn([py, "-m", "bench._fakes", "--decode-port", str(dport), "--openai-port", str(oport)],
                       tmp / "fakes.log"),
        "gateway": spawn([py, "-m", "gateway", "--config", str(gateway_config(tmp, gport, dport))],
                         tmp / "gateway.log", env),
    }
    if args.litellm:
        procs["litellm"] = spawn([args.litellm, "--config", str(litellm_config(tmp, oport)), "--host", "127.0.0.1",
                                  "--port", str(lport), "--num_workers", "1"], tmp / "litellm.log", lenv)
    try:
        targets = [Target("direct", f"http://127.0.0.1:{oport}"),
                   Target("disagg", f"http://127.0.0.1:{gport}", procs["gateway"])]
        if args.litellm:
            targets.append(Target("litellm", f"http://127.0.0.1:{lport}", procs["litellm"]))
        t_start = time.monotonic()
        async with aiohttp.ClientSession() as s:
            await wait_ready(s, f"http://127.0.0.1:{oport}/health", procs["fakes"], tmp / "fakes.log", 30)
            await wait_ready(s, f"http://127.0.0.1:{gport}/health", procs["gateway"], tmp / "gateway.log", 60)
            if args.litellm:
                await wait_ready(s, f"http://127.0.0.1:{lport}/health/liveliness", procs["litellm"],
                                 tmp / "litellm.log", 180)
        print(f"stack up in {time.monotonic() - t_start:.1f} s (fakes :{oport}/:{dport}, gateway :{gport}, "
              f"litellm :{lport}); load avg before: {os.getloadavg()[0]:.2f}", flush=True)
        for mode, stream in (("json", False), ("stream", True)):
            lat = await latency(targets, stream, args.requests, args.warmup)
            for t in targets:
                t.stats[mode] = lat[t.name]
                tp = await throughput(t, stream, args.clients, args.duration, args.warm_s)
                t.stats[mode]["errors"] += tp.pop("errors")
                t.stats[mode].update(tp)
                s_ = t.stats[mode]
                print(f"  {t.name:<8} {mode:<6} p50 {s_['p50']:6.2f} ms  p99 {s_['p99']:6.2f} ms  "
                      f"{s_['rps']:6.0f} req/s  {s_['cpu_us']:6.0f} CPU us/req", flush=True)
        report(targets, args)
        print(f"load avg after: {os.getloadavg()[0]:.2f}")
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="sequential requests per latency measurement")
    ap.add_argument("--warmup", type=int, default=30, help="sequential warm-up requests (answers are checked)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients (and pool size) for req/s")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of each req/s window")
    ap.add_argument("--warm-s", type=float, default=1.0, help="seconds of load before each req/s window")
    default = shutil.which("litellm", path=str(Path(sys.executable).parent)) or str(ROOT / ".venv-bench/bin/litellm")
    ap.add_argument("--litellm", default=default, help="LiteLLM proxy executable (default: %(default)s)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the temp folder with the processes' logs")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = ap.parse_args()
    if args.smoke:  # LiteLLM lives in a venv of its own (its pins clash with vLLM's): the smoke run leaves it out
        args.requests, args.warmup, args.clients, args.duration, args.warm_s = 5, 2, 4, 0.5, 0.2
        print("smoke run: our gateway against the direct backend only, no LiteLLM")
        args.litellm = None
    elif not Path(args.litellm).exists():
        sys.exit(f"no LiteLLM at {args.litellm}: python3 -m venv .venv-bench && "
                 ".venv-bench/bin/pip install 'litellm[proxy]'  (or pass --litellm PATH)")
    site_packages = Path(args.litellm or ".").resolve().parent.parent
    dist = sorted(site_packages.glob("lib/python*/site-packages/litellm-*.dist-info"))
    version = dist[-1].name.removesuffix(".dist-info").split("-", 1)[1] if dist else "?"
    print(f"python {platform.python_version()}, aiohttp {aiohttp.__version__}, cpus {os.cpu_count()}, "
          f"litellm {version} ({args.litellm})")
    tmp = Path(tempfile.mkdtemp(prefix="bench_gateway_"))
    try:
        from uvloop import run as loop_run
    except ImportError:
        loop_run = asyncio.run
    try:
        loop_run(run(args, tmp))
    finally:
        if args.keep_logs:
            print(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
