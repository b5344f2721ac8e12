"""`disagg up`'s supervisor on stand-in roles (tiny HTTP servers): a role killed with SIGKILL is restarted and
answers /health again while the others run on; a role that keeps dying stops everything; a stop request wins."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from backends.cli import up

SERVER = """
import sys, http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(name: str, tmp_path: Path) -> up.Child:
    port = _free_port()
    return up.Child(name, "decode", "127.0.0.1", port, [port], log=tmp_path / f"{name}.log")


def _starter(script: str):
    starts: list[str] = []

    def start(c: up.Child) -> None:
        starts.append(c.name)
        with open(c.log, "wb") as log:
            c.proc = subprocess.Popen([sys.executable, "-c", script, str(c.port)], stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
    return start, starts


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(up, "BACKOFF_S", (0.1, 0.2))
    monkeypatch.setattr(up, "POLL_S", 0.05)


def _run(children, stopper, start) -> tuple[threading.Thread, list[int]]:
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(up._supervise(children, stopper, start)), daemon=True)
    t.start()
    return t, rc


def _wait(cond, seconds: float = 30.0) -> bool:
    ev = threading.Event()
    for _ in range(int(seconds / 0.05)):
        if cond():
            return True
        ev.wait(0.05)
    return cond()


def test_a_killed_role_is_restarted_and_healthy_again(tmp_path, fast):
    start, starts = _starter(SERVER)
    children = [_child("prefill-0", tmp_path), _child("decode-0", tmp_path)]
    for c in children:
        start(c)
    assert _wait(lambda: all(up._healthy(c.health_url) for c in children))
    for c in children:
        c.ready = True
    stopper = up.Stopper()
    t, rc = _run(children, stopper, start)
    try:
        for victim in children:  # each role in turn
            old = victim.proc.pid
            os.kill(old, signal.SIGKILL)
            assert _wait(lambda: victim.proc.pid != old and victim.ready), f"{victim.name} not back"
            assert up._healthy(victim.health_url)
            other = next(c for c in children if c is not victim)
            assert other.proc.poll() is None  # the other role was left alone
        assert starts == ["prefill-0", "decode-0", "prefill-0", "decode-0"]
        assert (tmp_path / "prefill-0.log.1").exists()  # the dead run's log is kept
    finally:
        stopper.event.set()
        t.join(10)
        up.stop_all(children)
    assert rc == [0]
    assert all(c.proc.poll() is not None for c in children)


def test_a_role_that_keeps_dying_stops_everything(tmp_path, fast):
    start, starts = _starter("import sys; sys.exit(3)")
    c = _child("decode-0", tmp_path)
    start(c)
    c.proc.wait()
    t, rc = _run([c], up.Stopper(), start)
    t.join(30)
    assert rc == [1]
    assert len(starts) == 1 + up.MAX_FAILED_RESTARTS


def test_stop_request_during_backoff_returns_0(tmp_path, monkeypatch):
    monkeypatch.setattr(up, "BACKOFF_S", (60.0,))
    monkeypatch.setattr(up, "POLL_S", 0.05)
    start, starts = _starter("import sys; sys.exit(3)")
    c = _child("prefill-0", tmp_path)
    start(c)
    c.proc.wait()
    stopper = up.Stopper()
    t, rc = _run([c], stopper, start)
    assert _wait(lambda: c.restart_at is not None)
    stopper.event.set()
    t.join(10)
    assert rc == [0] and starts == ["prefill-0"]
    up.stop_all([c])
