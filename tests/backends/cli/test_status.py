"""`disagg status`: node table, fingerprint agreement, KV link probe over a real KVSender -> KVReceiver stream.

The in-process site serves the real probe routes (backends/probe.py) and /health from backends/common.node_app;
only the engines are left out. The e2e test runs the command against the real embedded stack.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from backends.cli import status
from backends.common import node_app
from backends.probe import register_decode, register_prefill
from kv_bridge.config.settings import load_config
from kv_bridge.fingerprint import kv_spec
from kv_bridge.receiver import KVReceiver
from tests.support.stack import MODEL_DIR, MODEL_ID, free_port

SECRET = "status-test-secret-0123456789"


def site_config(tmp_path: Path, auth: str = "") -> Path:
    nodes = ""
    for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"),
                       ("decode-1", "decode")):
        kv = f"kv_port = {free_port()}\n" if role == "decode" else ""
        nodes += f'[[nodes]]\nname = "{name}"\nrole = "{role}"\nport = {free_port()}\n{kv}\n'
    path = tmp_path / "config.toml"
    path.write_text(f"""[gateway]
host = "127.0.0.1"
port = {free_port()}

[auth]
node_secret = "{SECRET}"
{auth}

{nodes}
[[models]]
id = "{MODEL_ID}"
path = "{MODEL_DIR}"
prefill = ["prefill-0", "prefill-1"]
decode = ["decode-0", "decode-1"]
""")
    return path


async def serve_decode(settings, name: str, spec: dict) -> web.AppRunner:
    node = settings.node(name)
    svc = SimpleNamespace(settings=settings, node=node, models={MODEL_ID: SimpleNamespace(spec=spec)},
                          receiver=KVReceiver(settings.kv, settings.auth.kv_key(), settings.auth.kv_frame_mac))

    async def start(app):
        await svc.receiver.start(node.host, node.kv_port)

    async def stop(app):
        await svc.receiver.stop()

    health = lambda: {"role": "decode", "models": [MODEL_ID], "batch_size": 0, "cache_bytes": 0,  # noqa: E731
                      "transfers": len(svc.receiver.transfers), "fingerprint": {MODEL_ID: spec["fingerprint"]},
                      "quantization": {MODEL_ID: "float32"}}
    app = node_app(health, start, stop, token=settings.auth.node_token())
    register_decode(app, svc)
    return await _run(app, node)


async def serve_prefill(settings, name: str) -> web.AppRunner:
    node = settings.node(name)
    svc = SimpleNamespace(settings=settings, routes={m.id: m for m in settings.models})

    async def nothing(app):
        pass

    fp = kv_spec(MODEL_DIR)["fingerprint"]
    app = node_app(lambda: {"role": "prefill", "models": [MODEL_ID], "fingerprint": {MODEL_ID: fp}}, nothing,
                   nothing, token=settings.auth.node_token())
    register_prefill(app, svc)
    return await _run(app, node)


async def _run(app: web.Application, node) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, node.host, node.port).start()
    return runner


@pytest.fixture
async def site(tmp_path):
    settings = load_config(site_config(tmp_path))
    spec = kv_spec(MODEL_DIR)
    runners = [await serve_prefill(settings, "prefill-0"), await serve_decode(settings, "decode-0", spec),
               await serve_decode(settings, "decode-1", {**spec, "fingerprint": "0123456789abcdef"})]
    yield settings  # prefill-1 is configured but never started: down
    for r in runners:
        await r.cleanup()


async def test_status_table_flags_down_and_mismatch(site):
    result = await status.collect(site, probe_bytes=8 << 20, timeout=5)
    nodes = {n.name: n for n in result["nodes"]}
    assert nodes["prefill-0"].up and nodes["prefill-0"].agreement == "ok"
    assert nodes["decode-0"].agreement == "ok" and nodes["decode-0"].transfers == 0
    assert nodes["decode-1"].agreement.startswith("MISMATCH")
    assert not nodes["prefill-1"].up and "unreachable" in nodes["prefill-1"].error
    links = {(l.prefill, l.decode): l for l in result["links"]}
    good = links[("prefill-0", "decode-0")]
    assert good.ok and good.bytes >= (8 << 20) * 0.99 and good.gbit_s > 0, good
    bad = links[("prefill-0", "decode-1")]
    assert not bad.ok and "mismatch" in bad.error, bad  # the receiver refused the stream on the real KV path
    assert links[("prefill-1", "decode-0")].error == "node down"
    text = status.render(result)
    flagged = [line for line in text.splitlines() if line.startswith("!!")]
    assert any("prefill-1" in line and "DOWN" in line for line in flagged)
    assert any("decode-1" in line and "MISMATCH" in line for line in flagged)
    assert not any(line.split()[1] == "decode-0" for line in flagged if "->" not in line)
    assert json.loads(json.dumps(status.to_json(result)))["consensus"] == {MODEL_ID: nodes["prefill-0"].fingerprint[
        MODEL_ID]}


ROW = {"model": MODEL_ID, "prefill": "prefill-0", "decode": "decode-0", "state": "verified", "error": 0.02,
       "layer": 3, "tensor": "K", "tolerance": 0.38, "usable": True}


async def _fake_gateway(settings, key: str, operator: str | None = None, posts: list | None = None) -> web.AppRunner:
    """A gateway that wants `key`: /health with a queue and one verified pair; 401 without the key. POST /fidelity
    (recorded in `posts`) wants `operator` (else `key`): 200 the pair re-checked, 429 when asked twice."""
    def guarded(body, want=key):
        async def handler(request):
            if posts is not None and request.method == "POST":
                posts.append(request.headers.get("Authorization"))
                if len(posts) > 1:
                    return web.json_response({"error": {"message": "forced less than 60s ago"}}, status=429,
                                             headers={"Retry-After": "42"})
            if request.headers.get("Authorization") != f"Bearer {want}":
                return web.json_response({"error": {"message": "invalid API key"}}, status=401)
            return web.json_response(body)
        return handler

    app = web.Application()
    app.router.add_get("/health", guarded({"queue": {"models": {}, "waits": {}, "max_wait_s": 300},
                                           "fidelity": [ROW] if posts is not None else []}))
    app.router.add_post("/fidelity", guarded({"pairs": [{**ROW, "error": 0.01}]}, operator or key))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, settings.gateway.host, settings.gateway.port).start()
    return runner


async def test_status_from_a_machine_without_the_keys_file(tmp_path, monkeypatch):
    """The key from --api-key, $DISAGG_API_KEY or the file, in that order; none (the file unreadable here): one line
    that names the fix, and the table still comes (fidelity asked of the nodes, here all down)."""
    monkeypatch.delenv(status.API_KEY_ENV, raising=False)
    keys = tmp_path / "api-keys"
    keys.write_text("sk-from-the-file-0123456789abcdef\n")
    settings = load_config(site_config(tmp_path, f'api_keys_file = "{keys}"'))
    assert status.client_key(settings).key == "sk-from-the-file-0123456789abcdef"
    monkeypatch.setenv(status.API_KEY_ENV, "sk-from-the-env")
    assert status.client_key(settings).source == "$DISAGG_API_KEY"
    assert status.client_key(settings, "sk-flag").source == "--api-key"
    monkeypatch.delenv(status.API_KEY_ENV)
    keys.unlink()  # the gateway box's file, absent on this machine
    none = status.client_key(settings)
    assert none.key is None and "api_keys_file" in none.missing
    gateway = await _fake_gateway(settings, "sk-good")
    try:
        result = await status.collect(settings, probe_bytes=0, timeout=2, key=none)
        assert result["queue"] is None and "--api-key" in result["key"] and "DISAGG_API_KEY" in result["key"]
        assert {v.message for v in result["fidelity"]} == {"not read: no gateway answers (`disagg status --recheck` "
                                                           "runs the canary against the nodes)"}
        result = await status.collect(settings, probe_bytes=0, timeout=2, key=status.client_key(settings, "sk-bad"))
        assert "refused the API key from --api-key" in result["key"]
        result = await status.collect(settings, probe_bytes=0, timeout=2, key=status.client_key(settings, "sk-good"))
        assert result["key"] is None and result["queue"]["max_wait_s"] == 300 and result["fidelity"] == []
    finally:
        await gateway.cleanup()


async def test_status_reads_the_verdicts_and_only_recheck_runs_the_canary_with_the_operator_credential(
        tmp_path, monkeypatch):
    """Issue #50: plain `disagg status` runs no canary (GET /health's verdicts); --recheck POSTs /fidelity with the
    node token (an operator credential), and a 429 within the gateway's interval shows the standing verdicts."""
    monkeypatch.delenv(status.OPERATOR_KEY_ENV, raising=False)
    settings = load_config(site_config(tmp_path))
    token, posts = settings.auth.node_token(), []
    gateway = await _fake_gateway(settings, "sk-good", operator=token, posts=posts)
    key = status.client_key(settings, "sk-good")
    try:
        result = await status.collect(settings, probe_bytes=0, timeout=2, key=key)
        (v,) = result["fidelity"]
        assert posts == [] and v.state == "verified" and v.error == 0.02 and result["key"] is None
        op = status.operator_key(settings)
        assert op.source == "the node secret" and op.key == token
        result = await status.collect(settings, probe_bytes=0, timeout=2, key=key, recheck=op)
        assert posts == [f"Bearer {token}"] and result["fidelity"][0].error == 0.01
        result = await status.collect(settings, probe_bytes=0, timeout=2, key=key, recheck=op)
        assert "--recheck refused by the gateway (429 (Retry-After 42 s))" in result["key"]
        assert result["fidelity"][0].error == 0.02  # the standing verdict, read
        assert status.operator_key(settings, "op-flag").source == "--operator-key"
        over = status.verdict_of({**ROW, "over_allowance": True, "message": "measure this pair's own allowance"})
        (line,) = [x for x in status.render({"nodes": [], "links": [], "fidelity": [over]}).splitlines()
                   if "prefill-0 -> decode-0" in x]
        assert line.startswith("!!") and "verified (over allowance)" in line and status.passes(over)
    finally:
        await gateway.cleanup()


def test_agreement_sides_with_prefill_on_a_tie():
    n = [status.NodeStatus("p", "prefill", "", ["m"], up=True, fingerprint={"m": "a"}),
         status.NodeStatus("d", "decode", "", ["m"], up=True, fingerprint={"m": "b"})]
    assert status.agree(n) == {"m": "a"} and n[1].agreement == "MISMATCH m"


@pytest.mark.e2e
def test_status_command_on_the_embedded_stack(stack):
    """The session's real stack (conftest.py), every node up; a node shown DOWN is checked in test_faults_e2e.py, the
    test whose subject is killing and restarting decode-0."""
    cmd = [sys.executable, "-m", "backends.cli.main", "status", "--config", str(stack.config)]
    r = subprocess.run([*cmd, "--json", "--probe-mib", "16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert {n["name"]: (n["up"], n["agreement"]) for n in out["nodes"]} == {
        "prefill-0": (True, "ok"), "decode-0": (True, "ok")}
    assert out["nodes"][1]["quantization"] == {MODEL_ID: "float32"}
    (link,) = out["links"]
    assert link["ok"] and link["bytes"] > 15 << 20 and link["gbit_s"] > 0


def test_the_fidelity_table_says_stale_and_override_and_the_exit_status_follows_the_verdict():
    """Rows as the gateway's POST /fidelity answers them (gateway/cluster/fidelity.py): a verified pair whose last
    try hit a busy node stays verified and passes, marked stale with its age and cause; a failed pair an override
    vouches for passes with its reason shown; one with no verdict that could not run, or one being checked again
    after a restart, does not."""
    fig = {"error": 2e-5, "layer": 3, "tensor": "K", "tolerance": 0.01, "wire_dtype": "float32",
           "kv_dtype": "float32", "greedy": "8/8", "kl": 1e-6}
    rows = [
        {"model": "m", "prefill": "p0", "decode": "d0", "state": "verified", "usable": True, **fig, "stale": True,
         "age_s": 600.0, "errors": 2, "last_error": "http://d0 answered HTTP 429: over kv.max_inflight_bytes"},
        {"model": "m", "prefill": "p0", "decode": "d1", "state": "failed", "usable": True, **fig, "error": 0.4,
         "stale": False, "age_s": 5.0, "errors": 0, "last_error": None,
         "override": {"usable": True, "reason": "4-bit Mac, checked by hand"}},
        {"model": "m", "prefill": "p1", "decode": "d0", "state": "error", "usable": False, "errors": 4,
         "last_error": "KV did not arrive: timeout", "summary": "not checked: KV did not arrive: timeout"},
        {"model": "m", "prefill": "p1", "decode": "d1", "state": "checking", "usable": False,
         "reverify": "d1 restarted (boot id 1234abcd -> 5678ef01)"},
        {"model": "m", "prefill": "p2", "decode": "d0", "state": "failed", "usable": False, "error": None,
         "metric": "real-traffic position error", "message": "a request's KV failed the decode node's layer-0 "
         "check: K layer 0 position 650 error 1.4 (tolerance 0.1)", "stale": False, "errors": 0,
         "hold": {"count": 2, "left_s": 540.0, "until": "2026-11-28T10:42:13+00:00", "hold_s": 1200.0},
         "calibration": {"allowance": 0.05, "date": "2026-11-28T06:40:00+00:00", "reason": "20 canaries",
                         "gain_band": "gain band 30 layers x 3 KV heads, [0.71, 1.05], widths 0.06-0.09"}},
    ]
    verdicts = []
    for row in rows:
        v = status.verdict_of(row)
        v.lifecycle = status.Lifecycle.from_row(row)
        verdicts.append(v)
    assert [status.passes(v) for v in verdicts] == [True, True, False, False, False]
    lines = status.render({"nodes": [], "links": [], "fidelity": verdicts}).splitlines()
    stale, vouched, error, checking, held = (next(ln for ln in lines if f"{r['prefill']} -> {r['decode']}" in ln)
                                             for r in rows)
    assert held.startswith("!! ") and "demoted by real traffic (2 in a row), held until 2026-11-28T10:42:13+00:00 " \
        "(9min): a long canary, --recheck or calibrate lifts it" in held  # why and until when, first
    assert "calibrated 2026-11-28: allowance 0.05, gain band 30 layers x 3 KV heads" in verdicts[4].lifecycle.note()
    assert status.to_json({"nodes": [], "links": [], "consensus": {}, "fidelity": verdicts})["fidelity"][4][
        "hold"]["count"] == 2
    assert stale.startswith("!! ") and "verified (stale)" in stale and "stale (10min old): http://d0 answered HTTP 429" \
        in stale
    assert "FAILED" in vouched and "override (used): 4-bit Mac, checked by hand" in vouched
    assert "error" in error and "KV did not arrive: timeout" in error
    assert "being checked again: d1 restarted" in checking
    (js,) = [j for j in status.to_json({"nodes": [], "links": [], "consensus": {}, "fidelity": verdicts[:1]})["fidelity"]]
    assert js["state"] == "verified" and js["stale"] and js["age_s"] == 600.0 and js["errors"] == 2
