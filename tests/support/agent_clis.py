"""The coding-agent CLIs `make tools` installs (package.json's pins, into ./node_modules) and how a test runs one
against a gateway: a home and config of its own in a scratch folder, no approvals asked, telemetry off, and every
connection but the gateway's sent to a dead proxy (so nothing reaches the internet, and a try fails at once).

A clean checkout where `make tools` ran has them: a missing or wrong-version CLI fails the test with the fix, it is
not skipped. Only DISAGG_NO_AGENT_CLIS=1 (a machine without node) skips; DISAGG_AGENT_BIN names another folder."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"codex": "@openai/codex", "claude": "@anthropic-ai/claude-code"}
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once
# Read at import: the empty_config fixture clears DISAGG_* from the environment before a test runs.
AGENT_BIN = os.environ.get("DISAGG_AGENT_BIN")
NO_AGENT_CLIS = os.environ.get("DISAGG_NO_AGENT_CLIS")


def pinned(name: str) -> str:
    """The version package.json pins for CLI `name`."""
    return json.loads((REPO / "package.json").read_text())["devDependencies"][PACKAGES[name]]


def cli(name: str) -> str:
    """The path of CLI `name` ("codex", "claude") at its pinned version; fails (skips only when told) otherwise."""
    if NO_AGENT_CLIS:
        pytest.skip("DISAGG_NO_AGENT_CLIS is set: the agent CLIs are not installed here")
    folder = AGENT_BIN or str(REPO / "node_modules" / ".bin")
    path = shutil.which(name, path=folder)
    fix = "run `make tools` (npm ci of package.json's pins into ./node_modules; needs node and npm)"
    if path is None:
        pytest.fail(f"{name} is not in {folder}: {fix}")
    if AGENT_BIN is None:
        have = json.loads((REPO / "node_modules" / PACKAGES[name] / "package.json").read_text())["version"]
        if have != pinned(name):
            pytest.fail(f"{PACKAGES[name]} {have} is installed, package.json pins {pinned(name)}: {fix}")
    return path


def _env(home: Path, extra: dict) -> dict:
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR")}
    return {**keep, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
            "HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "ALL_PROXY": DEAD_PROXY,
            "http_proxy": DEAD_PROXY, "https_proxy": DEAD_PROXY, "all_proxy": DEAD_PROXY,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", **extra}


async def run(cmd: list[str], cwd: Path, home: Path, env: dict, timeout: float = 180) -> tuple[int, str, str]:
    """Run one CLI in `cwd` with `home` as its home (the machine's ~/.codex, ~/.claude must not reach the run) and
    only the environment named here. Returns rc, stdout, stderr."""
    home.mkdir(parents=True, exist_ok=True)
    p = await asyncio.create_subprocess_exec(*cmd, env=_env(home, env), cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(p.communicate(), timeout)
    except asyncio.TimeoutError:
        p.kill()
        await p.wait()
        raise
    return p.returncode, out.decode(), err.decode()


async def codex(prompt: str, url: str, model: str, cwd: Path, home: Path) -> tuple[int, str, str]:
    """`codex exec PROMPT` against the gateway at `url` (Responses API, streaming, store false), no approvals and no
    sandbox: the tool runs in `cwd` as it is."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "disagg"\napproval_policy = "never"\n'
        f'sandbox_mode = "danger-full-access"\n\n[analytics]\nenabled = false\n\n'
        f'[model_providers.disagg]\nname = "disagg"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
        f'env_key = "DISAGG_KEY"\n')
    cmd = [cli("codex"), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", prompt]
    return await run(cmd, cwd, home, {"DISAGG_KEY": "x", "CODEX_HOME": str(codex_home)})


async def claude(prompt: str, url: str, model: str, cwd: Path, home: Path, tools: str) -> tuple[int, str, str]:
    """`claude -p PROMPT` against the gateway at `url` (Messages API, streaming), `tools` allowed without asking,
    every model role (the main loop's and the small fast one's) named `model`."""
    env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "x", "CLAUDE_CONFIG_DIR": str(home / ".claude"),
           "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "ANTHROPIC_SMALL_FAST_MODEL": model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
           "ANTHROPIC_DEFAULT_OPUS_MODEL": model}
    cmd = [cli("claude"), "-p", prompt, "--model", model, "--allowedTools", tools]
    return await run(cmd, cwd, home, env)


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_ID = re.compile(r"\b(call|rs|fc|fco|msg)_[0-9a-f]{16,}\b")
_HEX64 = re.compile(r"\b[0-9a-f]{64}\b")
_HEADERS = ("user-agent", "originator", "anthropic-beta", "anthropic-version", "x-app", "accept")


def fixture(path: str, body: dict, headers: dict, scratch: Path) -> dict:
    """A recorded request as tests/support/data/agents keeps it: the scratch folder as /tmp/agent, session and device ids
    zeroed, our call and item ids numbered in order of appearance (a call and its result keep one id)."""
    text = json.dumps(body).replace(str(scratch), "/tmp/agent")
    text = _HEX64.sub("0" * 64, _UUID.sub("00000000-0000-0000-0000-000000000000", text))
    seen: dict[str, str] = {}
    text = _ID.sub(lambda m: seen.setdefault(m.group(0), f"{m.group(1)}_{len(seen) + 1}"), text)
    kept = {k.lower(): v for k, v in headers.items() if k.lower() in _HEADERS}
    return {"captured": {"method": "POST", "path": path, "headers": kept}, "body": json.loads(text)}
