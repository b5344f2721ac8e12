"""The gateway as a process: no torch/vllm/mlx on import, `python -m gateway` serves config.toml, stops cleanly."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.support.fakes import MODEL_DIR, MODEL_ID, FakeDecodeNode, FakePrefillNode, chat_body, free_port
from tests.support import ROOT

FORBIDDEN = ("torch", "vllm", "mlx", "mlx_lm", "transformers", "backends")
# Pure-Python kv_bridge modules the gateway shares with the nodes: the config (kv_bridge/config/, each module), the node protocol, and the stop-string
# matcher it runs after a mid-stream failover (the decode node's own, so both cut a stop string at the same place),
# the fidelity canary's contract (its settings, verdict and node calls), and the model families (each one's default
# reasoning and tool-call parsers).
GATEWAY_KV_BRIDGE = ("kv_bridge.config", "kv_bridge.keys", "kv_bridge.protocol", "kv_bridge.stops", "kv_bridge.fidelity",
                     "kv_bridge.families")



def _module(path: Path) -> str:
    """gateway/api/openai/chat.py -> gateway.api.openai.chat; a package's __init__.py -> the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


GATEWAY_FILES = sorted((ROOT / "gateway").rglob("*.py"))
GATEWAY_MODULES = [_module(p) for p in GATEWAY_FILES if _module(p) != "gateway"]
# Dependencies run one way inside the gateway (DESIGN.md): the client APIs use the text and cluster code, never the
# reverse, and the text code (templates, parsers) knows nothing of nodes.
LAYERS = {"gateway.cluster": ("gateway.api", "gateway.text"), "gateway.text": ("gateway.api", "gateway.cluster")}


def test_import_leaves_heavy_modules_out():
    """Every gateway module imported in a fresh interpreter: none pulls torch, vLLM, MLX or a backend in.

    One interpreter imports them all in turn (one each took 40 s of the quick tier): what a module imports stays
    loaded, so the heavy set after each import is the union over it and those before; the first non-empty one
    names the culprit, and the last is empty only if every module, imported alone, is clean."""
    code = (
        "import sys, json, importlib\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        f"    print(json.dumps([name, sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})]))"
    )
    modules = ["gateway", *GATEWAY_MODULES]
    out = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    seen = [json.loads(line) for line in out.stdout.splitlines()]
    assert [name for name, _ in seen] == modules
    assert [(name, heavy) for name, heavy in seen if heavy][:1] == []


PACKAGES = ("gateway", "backends", "kv_bridge")
ALL_FILES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
ALL_MODULES = {_module(p) for p in ALL_FILES}


def _imports(path: Path) -> set[str]:
    """The first-party modules `path` imports (dotted), at any depth of its tree (TYPE_CHECKING blocks, function
    bodies): `from pkg import name` counts as pkg.name when that is a module, else as pkg."""
    here = _module(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(x for x in (base, node.module or "") if x)
            if module.split(".")[0] not in PACKAGES:
                continue
            known = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in ALL_MODULES]
            out.update(known or [module])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
    return out - {_module(path)}


def _gateway_imports(path: Path) -> set[str]:
    """The gateway modules `path` imports (dotted), at any depth of its tree (TYPE_CHECKING blocks, function bodies)."""
    return {m for m in _imports(path) if m.startswith("gateway.")}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports) as a path that ends where it starts, or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after

    def visit(mod: str, stack: list[str]) -> list[str] | None:
        if state.get(mod) == "done" or mod not in graph:
            return None
        if state.get(mod) == "open":
            return [*stack[stack.index(mod):], mod]
        state[mod] = "open"
        for dep in sorted(graph[mod]):
            found = visit(dep, [*stack, mod])
            if found:
                return found
        state[mod] = "done"
        return None

    for mod in sorted(graph):
        found = visit(mod, [])
        if found:
            return found
    return None


def test_gateway_modules_have_no_import_cycle():
    graph = {_module(p): _gateway_imports(p) for p in GATEWAY_FILES}
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_import_cycle_in_any_package():
    """gateway, backends and kv_bridge together (imports across them included): no module reaches itself, not even
    through a TYPE_CHECKING block or a function-level import. Name what a module needs as a Protocol instead."""
    graph = {_module(p): _imports(p) for p in ALL_FILES}
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_cycle_finder_sees_a_cycle():
    """The check itself: a two-module cycle, a longer one, and none."""
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_module_stays_under_400_lines():
    """docs/architecture.md's rule: a module past 400 lines gets split where its parts meet."""
    for pkg in ("gateway", "backends", "kv_bridge"):
        for path in (ROOT / pkg).rglob("*.py"):
            n = len(path.read_text().splitlines())
            assert n < 400, f"{path.relative_to(ROOT)} has {n} lines"


def test_gateway_layers_depend_one_way():
    """cluster/ and text/ never import the client APIs, and text/ never imports cluster/ (nor the reverse)."""
    for path in GATEWAY_FILES:
        mod = _module(path)
        for layer, forbidden in LAYERS.items():
            if mod == layer or mod.startswith(layer + "."):
                bad = [d for d in _gateway_imports(path) if d.startswith(forbidden)]
                assert not bad, f"{mod} imports {bad}: dependencies run api -> text/cluster only"


def test_gateway_imports_only_kv_bridge_config():
    for path in GATEWAY_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN, f"{path.name} imports {name}"
                if top == "kv_bridge":
                    assert name.startswith(tuple(m + "." for m in GATEWAY_KV_BRIDGE)) or name in GATEWAY_KV_BRIDGE, \
                        f"{path.name} imports {name}"

def test_bad_config_exits_with_message(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    out = subprocess.run([sys.executable, "-m", "gateway", "--config", str(tmp_path / "missing.toml")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    assert "missing.toml" in out.stderr and "not found" in out.stderr

def _write_config(path: Path, port: int, decode: FakeDecodeNode, prefill: FakePrefillNode) -> None:
    path.write_text(f"""
[gateway]
host = "127.0.0.1"
port = {port}
health_interval_s = 0.2

[[nodes]]
name = "prefill-0"
role = "prefill"
port = {prefill.port}

[[nodes]]
name = "decode-0"
role = "decode"
port = {decode.port}
kv_port = {decode.kv_port}

[[models]]
id = "{MODEL_ID}"
path = "{MODEL_DIR}"
prefill = ["prefill-0"]
decode = ["decode-0"]
""")

async def test_serve_process(tmp_path):
    decode = await FakeDecodeNode("decode-0").start()
    prefill = await FakePrefillNode("prefill-0", [decode]).start()
    port = free_port()
    cfg = tmp_path / "config.toml"
    _write_config(cfg, port, decode, prefill)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--config", str(cfg), cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with aiohttp.ClientSession() as http:
            await _wait_healthy(http, f"http://127.0.0.1:{port}/health")
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body()) as r:
                assert r.status == 200 and r.headers["x-disagg-path"] == "disaggregated"
        proc.send_signal(signal.SIGINT)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, out.decode()
        assert f"127.0.0.1:{port}" in out.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await prefill.stop()
        await decode.stop()

async def _wait_healthy(http: aiohttp.ClientSession, url: str, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            async with http.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never answered 200")
