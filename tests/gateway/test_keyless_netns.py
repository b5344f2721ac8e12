"""Keyless clients over real sockets: the gateway process (tests/support/netns_gateway.py, fake nodes) in its own network
namespace, listening on its port and Ollama's 11434, two client namespaces joined to it by veth pairs with addresses
of our own. The official `ollama` client, with only OLLAMA_HOST set, is served from the network auth.keyless_networks
names, refused with Ollama's 401 from the other, and served from there with a key (OLLAMA_API_KEY)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.support import ROOT
from tests.support.fakes import MODEL_ID, REPLY
from tests.support.stack import terminate

KEY = "sk-netns-test-key"
TAG = f"d42{os.getpid() % 100000}"
GW, ALLOWED, OTHER = f"{TAG}gw", f"{TAG}a", f"{TAG}b"
# (client namespace, gateway side veth, client side veth, gateway address, client address)
LINKS = [(ALLOWED, f"{TAG}ga", f"{TAG}ca", "10.242.1.1", "10.242.1.2"),
         (OTHER, f"{TAG}gb", f"{TAG}cb", "10.242.2.1", "10.242.2.2")]

CLIENT = """
import json, ollama
try:
    r = ollama.generate(model=%r, prompt="What is the capital of France?")
    print(json.dumps({"ok": True, "response": r.response, "eval_count": r.eval_count}))
except ollama.ResponseError as e:
    print(json.dumps({"ok": False, "status": e.status_code, "error": e.error}))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _can_make_namespaces() -> str | None:
    if shutil.which("ip") is None or os.geteuid() != 0:
        return "needs root and iproute2 (ip netns)"
    probe = f"{TAG}probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add fails here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def namespaces():
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    made = []
    try:
        for ns in (GW, ALLOWED, OTHER):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for ns, gw_if, cl_if, gw_addr, cl_addr in LINKS:
            _ip("-n", GW, "link", "add", gw_if, "type", "veth", "peer", "name", cl_if, "netns", ns)
            _ip("-n", GW, "addr", "add", f"{gw_addr}/24", "dev", gw_if)
            _ip("-n", ns, "addr", "add", f"{cl_addr}/24", "dev", cl_if)
            _ip("-n", GW, "link", "set", gw_if, "up")
            _ip("-n", ns, "link", "set", cl_if, "up")
        yield
    finally:
        for ns in made:  # deleting a namespace deletes its veth ends, and so their peers
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def gateway(namespaces, tmp_path_factory):
    folder = tmp_path_factory.mktemp("netns")
    spec = {"gateway": {"host": "0.0.0.0", "port": 8000, "ollama_port": 11434},
            "auth": {"api_keys": [KEY], "keyless_networks": ["10.242.1.0/24"], "keyless_apis": ["ollama"]}}
    (folder / "spec.json").write_text(json.dumps(spec))
    (folder / "empty.toml").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    env.update(PYTHONPATH=str(ROOT), DISAGG_CONFIG=str(folder / "empty.toml"))
    log = open(folder / "gateway.log", "w")
    proc = subprocess.Popen(["ip", "netns", "exec", GW, sys.executable, "-m", "tests.support.netns_gateway",
                             str(folder / "spec.json")], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_listening(proc, folder / "gateway.log")
        yield proc
    finally:
        terminate(proc, 15)
        log.close()


def _wait_listening(proc: subprocess.Popen, log, timeout: float = 90) -> None:
    probe = "import socket; socket.create_connection(('10.242.1.1', 11434), 1).close()"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        if _in(ALLOWED, [sys.executable, "-c", probe]).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError("gateway did not listen: " + log.read_text())


def _in(ns: str, cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})})


def ollama_generate(ns: str, host: str, key: str | None = None) -> dict:
    """The official client's generate from namespace `ns`, configured only by its environment."""
    env = {"OLLAMA_HOST": host} | ({"OLLAMA_API_KEY": key} if key else {})
    r = _in(ns, [sys.executable, "-c", CLIENT % MODEL_ID], env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_keyless_from_the_allowed_network_is_served(gateway):
    got = ollama_generate(ALLOWED, "10.242.1.1:11434")
    assert got["ok"] and got["response"] == REPLY, got


def test_from_another_network_without_a_key_is_refused_with_ollamas_error(gateway):
    got = ollama_generate(OTHER, "10.242.2.1:11434")
    assert not got["ok"] and got["status"] == 401, got
    assert got["error"].startswith("unauthorized: Missing API key"), got


def test_with_a_key_from_anywhere_is_served(gateway):
    for ns, addr in ((OTHER, "10.242.2.1"), (ALLOWED, "10.242.1.1")):
        got = ollama_generate(ns, f"{addr}:11434", key=KEY)
        assert got["ok"] and got["response"] == REPLY, (ns, got)


def test_keyless_covers_only_the_apis_named(gateway):
    """The same allowed address on the gateway's own port: Ollama's API keyless, OpenAI's still asks for a key."""
    code = ("import json, urllib.request, urllib.error\n"
            "def get(u):\n"
            "    try:\n"
            "        with urllib.request.urlopen(u, timeout=30) as r: return r.status, json.loads(r.read())\n"
            "    except urllib.error.HTTPError as e: return e.code, json.loads(e.read())\n"
            "print(json.dumps([get('http://10.242.1.1:8000/api/tags'), get('http://10.242.1.1:8000/v1/models')]))")
    r = _in(ALLOWED, [sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    (tags_status, tags), (models_status, models) = json.loads(r.stdout)
    assert tags_status == 200 and [m["name"] for m in tags["models"]] == [MODEL_ID]
    assert models_status == 401 and models["error"]["code"] == "invalid_api_key"
