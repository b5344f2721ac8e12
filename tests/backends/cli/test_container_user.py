"""Every `disagg` command as the images run it (`docker run -u UID:GID`, a read-only root): uid 4242 with no passwd
entry, no HOME, / remounted read-only in a private mount namespace (one writable folder, as a container's volume), the
working directory read-only. Needs root and unshare(1); skipped, saying so, elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

SITE = ROOT / "examples" / "site-local.toml"
SMOL = ROOT / "models" / "smollm2-135m"
# In a private mount namespace: bind the writable folder onto itself (its own mount keeps rw), remount / read-only,
# then a user namespace where this uid (root outside) is 4242 inside: its files read as 4242's, no passwd entry.
AS_USER = ('mount --bind "$1" "$1" && mount -o remount,bind,ro / && shift && '
           'exec unshare -U --map-user=4242 --map-group=4242 env -u HOME -u TMPDIR "$@"')


def _can_unshare() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1)"
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", AS_USER, "sh", "/tmp", "true"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare does not work here: {r.stderr.strip()}"


WHY = _can_unshare() if sys.platform == "linux" else "Linux namespaces"
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))


def as_container_user(args: list[str], rw: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DISAGG_CONFIG", "HOME", "TMPDIR")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "backends.cli.main", *args]
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", AS_USER, "sh", str(rw), *cmd],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    print(f"$ disagg {' '.join(args)}  -> {r.returncode}\n{r.stdout}{r.stderr}")
    return r


@pytest.fixture
def site(tmp_path) -> Path:
    """site-local.toml with its secrets beside it (0600, the runner's: uid 4242's inside) and the smollm2 model's
    folder in tmp_path/rw, the one writable folder."""
    for name, text in (("node-secret", "container-test-secret-0123456789abcdef"),
                       ("api-keys", "sk-container-test-secret-0123456789abcdef")):
        (tmp_path / name).write_text(text + "\n")
        (tmp_path / name).chmod(0o600)
    (tmp_path / "rw").mkdir()
    text = SITE.read_text().replace('"../', f'"{ROOT}/')
    text = text.replace(f'"{ROOT}/.disagg/site/api-keys"', '"api-keys"').replace(
        f'"{ROOT}/.disagg/site/node-secret"', '"node-secret"')
    text = text.replace(f'path = "{ROOT}/models/smollm2-135m"', f'path = "{tmp_path}/rw/smollm2-135m"')
    (tmp_path / "site.toml").write_text(text)
    return tmp_path / "site.toml"


def _no_crash(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr and "KeyError" not in r.stderr, r.stderr


def test_doctor_runs_as_a_user_without_passwd_entry_or_home(site):
    for node in ("mac-0", "gateway"):
        r = as_container_user(["doctor", "--config", str(site), "--node", node], site.parent / "rw")
        _no_crash(r)
        assert r.returncode in (0, 1) and f"{node}: " in r.stdout.splitlines()[-1]
        assert "auth.node_secret_file: " in r.stdout and "owned by uid 4242, mode 0600" in r.stdout


def test_status_and_config_check_run_as_that_user(site):
    r = as_container_user(["status", "--config", str(site), "--probe-mib", "0", "--no-fidelity", "--timeout", "0.5"],
                          site.parent / "rw")
    _no_crash(r)
    assert r.returncode == 1 and "DOWN" in r.stdout  # nothing runs: every node down, said in the table
    # from the config's folder, as in an image (no docker/ there): the repository's docker/ files describe the seeds'
    # site, which `config check` compares with the config only when run from the repository root
    r = as_container_user(["config", "check", str(site)], site.parent / "rw", cwd=site.parent)
    _no_crash(r)
    assert r.returncode == 0 and "config OK" in r.stdout


def test_models_prepare_runs_as_that_user_with_a_read_only_root(site):
    """The gateway's files, then an mlx-lm 4-bit conversion (it imports torch, whose dill wants a writable temporary
    folder at import: /tmp is read-only here, /dev/shm is not, as under `docker run --read-only`)."""
    rw = site.parent / "rw"
    r = as_container_user(["models", "prepare", "--config", str(site), "--model", "smollm2:135m", "--role",
                           "gateway", "--hf", str(SMOL)], rw)
    _no_crash(r)
    assert r.returncode == 0 and (rw / "smollm2-135m" / "tokenizer.json").is_file()
    shutil.rmtree(rw / "smollm2-135m")
    r = as_container_user(["models", "prepare", "--config", str(site), "--model", "smollm2:135m", "--role",
                           "decode", "--hf", str(SMOL), "--bits", "4"], rw)
    _no_crash(r)
    assert r.returncode == 0 and "fingerprints agree" in r.stdout, r.stderr
    assert (rw / "smollm2-135m" / "model.safetensors").is_file()
