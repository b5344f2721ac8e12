"""The gateway process on two ports (gateway.port and gateway.ollama_port, gateway.app.serve) over fake nodes on
loopback, and `python -m gateway --probe`, the compose file's health check: 0 while /health answers on every port
the config names, 1 when one of them does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from tests.support import ROOT
from tests.support.fakes import MODEL_ID, free_port


def _env(config) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    return {**env, "PYTHONPATH": str(ROOT), "DISAGG_CONFIG": str(config)}


def probe(config) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", "--probe", "--config", str(config)], cwd=ROOT,
                          env=_env(config), capture_output=True, text=True, timeout=60)


def test_serves_both_ports_and_the_probe_reads_them_from_the_config(tmp_path):
    port, ollama_port, missing = free_port(), free_port(), free_port()
    spec = {"gateway": {"host": "127.0.0.1", "port": port, "ollama_port": ollama_port}, "auth": {}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "empty.toml").write_text("")
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.netns_gateway", str(tmp_path / "spec.json")],
                            cwd=ROOT, env=_env(tmp_path / "empty.toml"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ollama_port}/api/tags", timeout=2) as r:
                    assert [m["name"] for m in json.loads(r.read())["models"]] == [MODEL_ID]
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
                time.sleep(0.3)
        for p in (port, ollama_port):
            with urllib.request.urlopen(f"http://127.0.0.1:{p}/health", timeout=5) as r:
                assert r.status == 200
        good = tmp_path / "good.toml"
        good.write_text(f'[gateway]\nhost = "0.0.0.0"\nport = {port}\nollama_port = {ollama_port}\n')
        r = probe(good)
        assert r.returncode == 0, r.stderr
        bad = tmp_path / "bad.toml"  # the compose file's old probe: a port the gateway does not listen on
        bad.write_text(f'[gateway]\nhost = "127.0.0.1"\nport = {port}\nollama_port = {missing}\n')
        r = probe(bad)
        assert r.returncode == 1 and f"127.0.0.1:{missing}/health" in r.stderr, r.stderr
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}" in out and f"http://127.0.0.1:{ollama_port}" in out, out


def test_a_port_held_by_another_process_is_a_config_error_naming_it(tmp_path):
    """Ollama itself still on 11434: the gateway refuses to start and says what to stop."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        taken = held.getsockname()[1]
        (tmp_path / "config.toml").write_text(
            f'[gateway]\nhost = "127.0.0.1"\nport = {free_port()}\nollama_port = {taken}\n')
        r = subprocess.run([sys.executable, "-m", "gateway", "--config", str(tmp_path / "config.toml")], cwd=ROOT,
                           env=_env(tmp_path / "config.toml"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{taken} (gateway.ollama_port)" in r.stderr
    assert "Ollama itself still running? stop it" in r.stderr
