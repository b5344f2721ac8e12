"""`disagg up`: start this machine's roles from the config as child processes, wait until every one answers
GET /health, print the URL, restart a role that dies later (with backoff); Ctrl-C or SIGTERM stops everything."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kv_bridge.config.models import resolve_model_path
from kv_bridge.config.settings import Settings
from kv_bridge.config.source import ConfigError

READY_TIMEOUT_S = 900.0  # vLLM's first start on a 2-core CPU box compiles and profiles for minutes
STOP_GRACE_S = 15.0
POLL_S = 0.5
NOTE_EVERY_S = 30.0
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # wait before restart n; a role healthy for STABLE_S starts again at 1 s
STABLE_S = 60.0
MAX_FAILED_RESTARTS = 5  # restarts in a row that die before answering /health: the role is broken, stop all
STATE_DIR = ".disagg"
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Child:
    name: str
    role: str  # prefill | decode | gateway
    host: str
    port: int
    ports: list[int]  # every port this role binds; checked free before start
    log: Path = Path()
    proc: subprocess.Popen | None = None
    ready: bool = False
    headers: dict[str, str] = field(default_factory=dict)  # credentials its /health wants (docs/security.md)
    restarts: int = 0  # restarts that have not yet been healthy for STABLE_S
    restart_at: float | None = None  # monotonic time of the pending restart (the role is dead meanwhile)
    started_at: float = 0.0

    @property
    def health_url(self) -> str:
        return f"http://{_connect_host(self.host)}:{self.port}/health"


@dataclass
class Stopper:
    """Turns SIGINT/SIGTERM into flags the main loop polls; a second signal skips the grace period."""
    event: threading.Event = field(default_factory=threading.Event)
    hurry: bool = False
    _old: dict = field(default_factory=dict)

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        if self.event.is_set():
            self.hurry = True
        self.event.set()

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def wait(self, seconds: float) -> None:
        self.event.wait(seconds)


def up(settings: Settings, config_path: str | os.PathLike, *, ready_timeout_s: float = READY_TIMEOUT_S,
       children: list[Child] | None = None, start=None, log_dir: Path | None = None) -> int:
    """Run until stopped; 0 after a requested stop, 1 when a role failed or never became ready. `children`,
    `start(child, config_path, log_dir)` and `log_dir` default to plan(), _start and .disagg/logs (site.py: links)."""
    config_path = Path(config_path).resolve()
    children = plan(settings) if children is None else children
    preflight(settings, children)
    start = start or _start
    log_dir = log_dir or config_path.parent / STATE_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stopper = Stopper()
    stopper.install()
    started: list[Child] = []
    try:
        for child in children:
            if stopper.requested:
                return 0
            start(child, config_path, log_dir)
            started.append(child)
            print(f"disagg up: started {child.name} (pid {child.proc.pid}), log {child.log}", flush=True)
        rc = _wait_ready(started, stopper, ready_timeout_s)
        if rc is None:
            _print_ready(settings, started)
            rc = _supervise(started, stopper, lambda c: start(c, config_path, log_dir))
        return rc
    finally:
        stop_all(started, stopper)
        stopper.restore()


def plan(settings: Settings) -> list[Child]:
    """Nodes whose host is this machine, then the gateway; nodes elsewhere are left to their own `disagg`."""
    children = []
    for node in settings.nodes:
        if not _is_local(node.host):
            print(f"disagg up: skipping {node.name} on {node.host} (run `disagg {node.role} --node {node.name}` there)")
            continue
        ports = [node.port] + ([node.kv_port] if node.kv_port else [])
        token = settings.auth.node_token()
        children.append(Child(node.name, node.role, node.host, node.port, ports,
                              headers={"Authorization": f"Bearer {token}"} if token else {}))
    gw = settings.gateway
    if _is_local(gw.host):
        keys = settings.auth.client_keys() if settings.auth.protect_health else []
        children.append(Child("gateway", "gateway", gw.host, gw.port, [gw.port],
                              headers={"Authorization": f"Bearer {keys[0]}"} if keys else {}))
    if not children:
        raise ConfigError("no role in the config runs on this machine: set a node's or [gateway] host to a local "
                          "address (127.0.0.1), or run `disagg <role>` on the machines named there")
    return children


def preflight(settings: Settings, children: list[Child]) -> None:
    """Fail before starting anything: a busy port or an unprepared model would otherwise surface minutes later."""
    problems = []
    seen: dict[tuple[str, int], str] = {}  # by address: a site on one machine reuses ports on 127.0.x.y
    for c in children:
        for port in c.ports:
            if (c.host, port) in seen:
                problems.append(f"port {port} on {c.host} is used by both {seen[c.host, port]} and {c.name}; give "
                                f"each its own port")
            seen[c.host, port] = c.name
            if not _port_free(c.host, port):
                problems.append(f"{c.name}: port {port} on {c.host} is in use (another `disagg up`?); stop that "
                                f"process or change the port in the config")
    problems += _model_problems(settings, {c.name for c in children})
    if problems:
        raise ConfigError("disagg up cannot start:\n  " + "\n  ".join(problems))


def _model_problems(settings: Settings, local: set[str]) -> list[str]:
    from backends.cli import models  # cheap: the heavy imports in models.py are inside prepare()

    problems = []
    for route in settings.models:
        if not local & set(route.prefill + route.decode):
            continue
        path = resolve_model_path(route)
        found = models.check(path, route.id) if route.id in models.EMBEDDED else (
            [] if (path / "config.json").is_file() else [f"{path} has no config.json"])
        if found:
            problems.append(f"model {route.id!r} at {path} is not ready ({'; '.join(found)}); "
                            f"run `disagg models prepare` (or `make models`)")
    return problems


def _start(child: Child, config_path: Path, log_dir: Path) -> None:
    node = ["--node", child.name] if child.role != "gateway" else []
    cmd = [sys.executable, "-m", "backends.cli.main", child.role, *node, "--config", str(config_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", DISAGG_CONFIG=str(config_path))
    # Children must import this very checkout, whatever the caller's working directory.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    child.log = log_dir / f"{child.name}.log"
    with open(child.log, "wb") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        # Own session = own process group, so stop_all reaches grandchildren (vLLM's EngineCore) too.
        child.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True, preexec_fn=_death_signal_hook())


def _wait_ready(children: list[Child], stopper: Stopper, timeout_s: float) -> int | None:
    """None once all children answer /health with 200; otherwise the exit code to return."""
    t0 = last_note = time.monotonic()
    while not all(c.ready for c in children):
        if stopper.requested:
            return 0
        for c in children:
            if c.proc.poll() is not None:
                _report_exit(c)
                return 1
            if not c.ready and _healthy(c.health_url, c.headers):
                c.ready = True
                print(f"disagg up: {c.name} ready after {time.monotonic() - t0:.0f}s", flush=True)
        now = time.monotonic()
        if now - t0 > timeout_s:
            waiting = [f"{c.name} (log {c.log})" for c in children if not c.ready]
            print(f"disagg up: not ready after {timeout_s:.0f}s: {', '.join(waiting)}", file=sys.stderr)
            return 1
        names = [c.name for c in children if not c.ready]
        if names and now - last_note > NOTE_EVERY_S:  # none left: the last became ready in this pass
            last_note = now
            print(f"disagg up: waiting for {', '.join(names)} ({now - t0:.0f}s)", flush=True)
        stopper.wait(POLL_S)
    return None


def _supervise(children: list[Child], stopper: Stopper, start: Callable[[Child], None]) -> int:
    """Restart each role that dies, after a backoff, while the others keep serving; 0 once stopped, 1 when a role
    keeps dying before it ever answers /health again."""
    while not stopper.requested:
        now = time.monotonic()
        for c in children:
            if c.restart_at is None and c.proc.poll() is not None:
                if not _on_death(c, now):
                    return 1
            elif c.restart_at is not None and now >= c.restart_at:
                _restart(c, start)
            elif c.restart_at is None and not c.ready:
                _check_back(c, now)
            elif c.ready and c.restarts and now - c.started_at > STABLE_S:
                c.restarts = 0  # stable again: the next death starts the backoff from the bottom
        stopper.wait(POLL_S)
    return 0


def _on_death(c: Child, now: float) -> bool:
    """Log the exit and schedule the restart; False when the role has failed too often in a row to go on."""
    _report_exit(c)
    _signal_group(c, signal.SIGKILL)  # orphans of the dead role (vLLM's EngineCore) would hold its memory and ports
    if not c.ready and c.restarts >= MAX_FAILED_RESTARTS:
        print(f"disagg up: {c.name} died {c.restarts} times in a row before answering /health; giving up "
              f"(log {c.log})", file=sys.stderr, flush=True)
        return False
    delay = BACKOFF_S[min(c.restarts, len(BACKOFF_S) - 1)]
    c.ready, c.restart_at = False, now + delay
    print(f"disagg up: restarting {c.name} in {delay:.0f}s (restart {c.restarts + 1}); the others keep serving",
          file=sys.stderr, flush=True)
    return True


def _restart(c: Child, start: Callable[[Child], None]) -> None:
    c.restarts += 1
    c.restart_at = None
    _rotate(c.log)
    start(c)
    c.started_at = time.monotonic()
    print(f"disagg up: restarted {c.name} (pid {c.proc.pid}), log {c.log}", flush=True)


def _check_back(c: Child, now: float) -> None:
    if _healthy(c.health_url, c.headers):
        c.ready = True
        print(f"disagg up: {c.name} is back after {now - c.started_at:.0f}s", flush=True)


def _rotate(log: Path) -> None:
    """Keep the dead run's log as <name>.log.1 for the post-mortem; the new run writes <name>.log."""
    try:
        log.replace(log.with_name(log.name + ".1"))
    except OSError:
        pass


def stop_all(children: list[Child], stopper: Stopper | None = None) -> None:
    """SIGTERM every process group, wait up to STOP_GRACE_S for them to empty, then SIGKILL what is left."""
    if not children:
        return
    print("disagg up: stopping " + ", ".join(c.name for c in children), flush=True)
    for c in reversed(children):  # gateway first, so it stops taking requests before nodes vanish
        _signal_group(c, signal.SIGTERM)
    hurry = lambda: stopper is not None and stopper.hurry  # noqa: E731
    _wait_groups(children, STOP_GRACE_S, hurry)
    stubborn = [c for c in children if _group_alive(c)]
    for c in stubborn:
        print(f"disagg up: {c.name} did not stop in {STOP_GRACE_S:.0f}s; killing its process group", flush=True)
        _signal_group(c, signal.SIGKILL)
    _wait_groups(stubborn, 5.0, lambda: False)
    print("disagg up: stopped", flush=True)


def _wait_groups(children: list[Child], seconds: float, hurry) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not hurry():
        if not any(_group_alive(c) for c in children):
            return
        time.sleep(0.1)


def _signal_group(c: Child, sig: int) -> None:
    try:
        os.killpg(c.proc.pid, sig)  # start_new_session: pgid == the child's pid
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(c: Child) -> bool:
    if c.proc.poll() is None:  # also reaps the leader, so a dead one stops counting
        return True
    try:
        os.killpg(c.proc.pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _report_exit(c: Child) -> None:
    print(f"disagg up: {c.name} exited with code {c.proc.returncode}; last lines of {c.log}:", file=sys.stderr)
    for line in _tail(c.log, 40):
        print(f"  {c.name} | {line}", file=sys.stderr)


def _tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=n)]
    except OSError:
        return []


def _print_ready(settings: Settings, children: list[Child]) -> None:
    gw = next((c for c in children if c.role == "gateway"), None)
    if gw is None:
        print("disagg up: ready (no gateway on this machine). Ctrl-C stops everything.", flush=True)
        return
    from backends.cli.status import await_fidelity

    for line in await_fidelity(f"http://{_connect_host(gw.host)}:{gw.port}/health", gw.headers,
                               settings.fidelity.timeout_s if settings.fidelity.enabled else 0,
                               {c.name for c in children}):
        print(f"disagg up: {line}", flush=True)
    url = f"http://{_connect_host(gw.host)}:{gw.port}/v1"
    model = settings.models[0].id if settings.models else "smollm2:135m"
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "What is the capital of France?"}], '
            '"temperature": 0, "max_tokens": 32}' % model)
    print(f"disagg up: ready at {url}", flush=True)
    print(f"  curl -i {url}/chat/completions -H 'Content-Type: application/json' -d '{body}'")
    print(f"  logs in {gw.log.parent}; Ctrl-C stops everything.", flush=True)


def _healthy(url: str, headers: dict[str, str] | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _connect_host(host: str) -> str:
    """Where to reach a server bound to `host` from this machine (wildcards mean loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _is_local(host: str) -> bool:
    """A host is this machine when one of its addresses can be bound here."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
                return True
        except OSError:
            continue
    return False


def _port_free(host: str, port: int) -> bool:
    # SO_REUSEADDR like the servers themselves, so TIME_WAIT leftovers don't count as busy.
    for family, _, _, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr[:2] if family == socket.AF_INET else addr)
            except OSError:
                return False
    return True


def _death_signal_hook():
    """Linux: make the child get SIGTERM if `disagg up` itself dies (even by SIGKILL), so roles never outlive it.

    libc is resolved here, in the parent: the hook runs between fork and exec, where importing is unsafe.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    PR_SET_PDEATHSIG = 1
    return lambda: prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
