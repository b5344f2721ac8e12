"""The `disagg` command as a user runs it (this checkout's code, no DISAGG_ variables leaking in) and the
configurations its tests write: a file, the seed site's example with its secrets, a twin of the embedded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

SITE = ROOT / "examples" / "site.toml"
MODEL_DIR = ROOT / "models" / "smollm2-135m"


def _disagg() -> list[str]:
    exe = Path(sys.executable).with_name("disagg")  # the console script of the venv running the tests
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "backends.cli.main"]


def run(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    # this checkout's code, not the one the venv's editable install points at (a git worktree shares the venv)
    clean["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(_disagg() + list(args), cwd=cwd, env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def write(tmp_path: Path, text: str, name: str = "bad.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def assert_config_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, f"{needle!r} not in:\n{r.stderr}"


def site_copy(tmp_path: Path, secrets: bool = True, edit=lambda text: text) -> Path:
    path = write(tmp_path, edit(SITE.read_text()), "site.toml")
    if secrets:
        (tmp_path / "node-secret").write_text("0123456789abcdef0123456789abcdef\n")
        (tmp_path / "api-keys").write_text("# clients\nsk-grader-0123456789\n")
    return path


def twin(tmp_path: Path, name: str, config=None, tokenizer=None) -> Path:
    """A copy of the embedded model's metadata (weights linked), with config.json / tokenizer.json rewritten."""
    out = tmp_path / name
    out.mkdir()
    for p in MODEL_DIR.iterdir():
        (out / p.name).symlink_to(p.resolve())
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    tok = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").write_text(json.dumps(tokenizer(tok) if tokenizer else tok, indent=4))  # re-saved
    return out
