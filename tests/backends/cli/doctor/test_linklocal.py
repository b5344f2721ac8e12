"""doctor on the seeds' link-local switch (backends/cli/doctor/linklocal.py): the route lookups' output parsed, and in
a network namespace of our own with the seeds' addresses on veth interfaces (nothing is sent; no packet leaves the
namespace), one interface on 169.254/16 passes, a second one (a Mac's Thunderbolt Bridge) fails, and so does a route
to a peer that leaves by it. Also the gateway's Ollama port held by something else (a plain Ollama): one failing line."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from backends.cli.doctor import linklocal
from backends.cli.doctor import report as doctor
from kv_bridge.config.settings import load_config
from tests.support import ROOT

SEEDS = ROOT / "examples" / "site-seeds.toml"
NS = f"d42ll{os.getpid() % 100000}"

CHECK = """
import json, sys
from pathlib import Path
from backends.cli.doctor import linklocal
from backends.cli.doctor.checks import Ctx
from kv_bridge.config.settings import load_config
s = load_config(sys.argv[1])
ctx = Ctx(s, Path(sys.argv[1]), s.node(sys.argv[2]), {})
print(json.dumps([[c.name, c.status, c.detail] for c in linklocal.check_link_local(ctx)]))
"""


def test_route_lookups_are_parsed():
    linux = "169.254.150.101 dev enP7s7 src 169.254.150.103 uid 0 \\    cache "
    assert linklocal.parse_ip_route_get(linux) == ("enP7s7", "169.254.150.103")
    mac = ("   route to: 169.254.150.103\ndestination: 169.254.0.0\n       mask: 255.255.0.0\n  interface: bridge0\n"
           "      flags: <UP,DONE,CLONING,STATIC>\n")
    assert linklocal.parse_route_get(mac) == ("bridge0", None)


def test_a_config_off_link_local_has_no_such_lines():
    s = load_config(ROOT / "examples" / "site-local.toml")
    ctx = doctor.Ctx(s, ROOT / "examples" / "site-local.toml", s.node("spark-0"), {})
    assert linklocal.check_link_local(ctx) == []


@pytest.fixture
def netns():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (ip netns)")
    r = subprocess.run(["ip", "netns", "add", NS], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"ip netns add fails here: {r.stderr.strip()}")
    def ip(*args):
        subprocess.run(["ip", "-n", NS, *args], check=True, capture_output=True, timeout=30)

    def port(dev):  # an interface of ours: one end of a veth pair, both ends up (no dummy module on every kernel)
        ip("link", "add", dev, "type", "veth", "peer", "name", f"{dev}p")
        ip("link", "set", f"{dev}p", "up")
        ip("link", "set", dev, "up")

    ip.port = port
    try:
        yield ip
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def checks_in_ns(node: str) -> dict[str, tuple[str, str]]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(["ip", "netns", "exec", NS, sys.executable, "-c", CHECK, str(SEEDS), node], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return {name: (status, detail) for name, status, detail in json.loads(r.stdout)}


def test_one_interface_on_the_switch_passes(netns):
    """DGX Spark 1 (gateway + spark-1) with its one 10GbE port on the switch."""
    netns.port("sw0")
    netns("addr", "add", "169.254.150.103/16", "dev", "sw0")
    got = checks_in_ns("spark-1")
    assert got["link-local"][0] == "ok" and "only sw0" in got["link-local"][1], got
    peer = "mac-studio-1"  # the Mac its model decodes on: its KV goes out by sw0, from its own address
    assert got[f"route to {peer}"] == ("ok", f"{SEEDS_ADDR[peer]} leaves by sw0 from 169.254.150.103"), got
    assert "route to mac-studio-2" not in got  # gpt-oss's Mac: spark-1 sends it no KV
    assert "route to gateway" not in got  # the gateway is this machine


SEEDS_ADDR = {"mac-studio-1": "169.254.150.101", "mac-studio-2": "169.254.150.102"}


def test_a_second_interface_on_the_same_16_fails_and_so_does_the_route_it_takes(netns):
    """A Mac's Thunderbolt Bridge with a self-assigned 169.254 address, holding the /16's only route."""
    for dev in ("en0", "bridge0"):
        netns.port(dev)
    netns("addr", "add", "169.254.150.101/16", "dev", "en0", "noprefixroute")
    netns("addr", "add", "169.254.33.7/16", "dev", "bridge0")
    got = checks_in_ns("mac-studio-1")
    status, detail = got["link-local"]
    assert status == "FAIL" and "en0 169.254.150.101/16" in detail and "bridge0 169.254.33.7/16" in detail, got
    status, detail = got["route to gateway"]
    assert status == "FAIL" and "169.254.150.103 leaves by bridge0" in detail and "not en0" in detail, got


def test_the_gateways_ollama_port_held_by_another_process_is_one_failing_line(tmp_path, monkeypatch):
    """A plain Ollama still running on the gateway's machine holds 11434: said, with the port, as a failure."""
    monkeypatch.delenv("DISAGG_CONFIG", raising=False)
    with socket.socket() as ollama, socket.socket() as free:
        ollama.bind(("127.0.0.1", 0))
        ollama.listen(1)
        free.bind(("127.0.0.1", 0))
        port, held = free.getsockname()[1], ollama.getsockname()[1]
        free.close()
        text = (ROOT / "examples" / "site-local.toml").read_text().replace('"../', f'"{ROOT}/')
        text = text.replace("[gateway]\nhost = \"127.0.0.1\"\nport = 8000\n",
                            f"[gateway]\nhost = \"127.0.0.1\"\nport = {port}\nollama_port = {held}\n")
        config = tmp_path / "site.toml"
        config.write_text(text)
        checks = {c.name: c for c in doctor.run(load_config(config), config, "gateway", timeout=0.5)}
    assert checks["gateway port"].status == "ok"
    assert checks["gateway ollama_port"].status == "FAIL" and f"127.0.0.1:{held} is busy" in \
        checks["gateway ollama_port"].detail
