"""docs/deploy.md as written: its command blocks, extracted in order, each run here when it can be (with /opt/disagg
a temporary folder, the repository a copy), the others listed with why. Compose runs `config` with the `.env` the
guide has written by then (Debian's docker-compose v1 here; the guide says `docker compose`), the install script
goes through shellcheck, and each `disagg` command through `--help` and its dry run (`config check`)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import run as disagg
from tests.support import ROOT

GUIDE = ROOT / "docs" / "deploy.md"

# What cannot run on this machine (Linux, no Docker daemon, no GPU, no Mac, no hub, no site), by the command's start.
SKIP = [
    (r"^sudo ", "needs root on the site's machine (creates /opt/disagg, drop_caches, systemctl)"),
    (r"^sync; echo 3", "drops the page cache: root, and meant for a GB10 after a download"),
    (r"^docker build", "no Docker daemon here (the Dockerfiles go through hadolint in test_deploy_files)"),
    (r"^docker run", "no Docker daemon or GPU here (the flags are config check's, tested in test_config_budget)"),
    (r"^alias ", "wraps `docker run` (no daemon here); the disagg commands it stands for run below"),
    (r"^launchctl ", "macOS launchd (the plists are checked in test_deploy_files)"),
    (r"^scp ", "copies from the site's gateway box (no site network here)"),
    (r"^\.venv/bin/python -m bench\.", "measures the running site (tests/bench/test_site_target.py runs bench_split's "
     "--config path against loopback fakes)"),
    (r"mlx_lm\.convert ", "downloads the 65 GB checkpoint (no hub here); run on a tiny one in the official format by "
     "test_gpt_oss_mac_commands_run_as_written"),
    (r"^python3\.12 -m venv |/\.venv/bin/(pip|python) ", "the Spark's venv route: CUDA 13 aarch64 wheels (no GPU or "
     "network here; its check is tested in tests/backends/cli/doctor/test_gpu_arch.py)"),
    (r"^(KEY=|for m in|curl |echo$|done$)", "needs the running site (make site's e2e tests send both APIs' requests)"),
]


def commands(text: str) -> list[str]:
    """Indented code blocks in order, split into commands: continuation lines and heredocs joined, comments off."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            block = []
            while i < len(lines) and lines[i].startswith("    "):
                block.append(lines[i].strip())
                i += 1
            out += _split(block)
        i += 1
    return out


def _split(block: list[str]) -> list[str]:
    cmds, cur, heredoc = [], "", None
    for line in block:
        if heredoc:
            cur += "\n" + line
            if line == heredoc:
                cmds.append(cur)
                cur, heredoc = "", None
            continue
        code = re.sub(r"\s+#.*$", "", line) if not line.startswith("#") else ""
        if not code:
            continue
        cur = cur[:-1] + " " + code if cur.endswith("\\") else code
        m = re.search(r"<<(\w+)$", cur)
        if m:
            heredoc = m.group(1)
        elif not cur.endswith("\\"):
            cmds.append(cur)
            cur = ""
    return cmds


def test_guide_blocks_in_order(tmp_path):
    opt, repo = tmp_path / "opt", tmp_path / "repo"
    opt.mkdir()
    repo.mkdir()
    shutil.copytree(ROOT / "docker", repo / "docker")
    shutil.copytree(ROOT / "examples", repo / "examples")
    ran, skipped = [], []
    for cmd in commands(GUIDE.read_text()):
        why = next((w for pat, w in SKIP if re.search(pat, cmd)), None)
        if why:
            skipped.append((cmd, why))
            continue
        local = cmd.replace("/opt/disagg", str(opt))
        words = re.sub(r"^\S*/disagg ", "disagg ", local).split()
        if words[0] == "disagg":
            _disagg(words[1:], repo, opt)
        elif words[0] in ("docker", "docker-compose"):
            _compose(local, repo)
        elif words[0] == "docker/install-mac.sh":
            r = subprocess.run(["shellcheck", str(ROOT / "docker/install-mac.sh")], capture_output=True, text=True)
            assert r.returncode == 0, r.stdout
        else:  # cp, python3 -c, chmod, cat > docker/.env <<EOF ...
            r = subprocess.run(["bash", "-euc", local], cwd=repo, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (cmd, r.stderr)
        ran.append(cmd)
    print("\nRAN:\n" + "\n".join(ran) + "\n\nNOT RUN HERE:\n" + "\n".join(f"{c[:90]}  -- {w}" for c, w in skipped))
    assert (repo / "docker/.env").stat().st_mode & 0o777 == 0o600
    assert (opt / "node-secret").stat().st_mode & 0o777 == 0o600
    assert any("doctor" in c for c in ran) and any("compose" in c for c in ran) and any("config check" in c for c in ran)
    assert len(ran) >= 10 and all(w for _, w in skipped)


def _disagg(args: list[str], repo: Path, opt: Path) -> None:
    """Each disagg command: its --help; `config check` for real on the guide's config (its dry run), from the
    repository's root as section 2's alias runs it, so the compose file and Prometheus targets are checked too."""
    sub = args[:2] if args[0] in ("models", "config") else args[:1]
    r = disagg(*sub, "--help", cwd=repo)
    assert r.returncode == 0 and "usage: disagg" in r.stdout, (args, r.stderr)
    if sub == ["config", "check"]:
        r = disagg("config", "check", str(opt / "config.toml"), cwd=repo)
        assert r.returncode == 0 and "config OK" in r.stdout, r.stdout + r.stderr
        assert "docker/compose.yaml not here" not in r.stdout and "sudo ufw allow 11434/tcp" in r.stdout


def _compose(cmd: str, repo: Path) -> None:
    """`docker compose -f docker/compose.yaml -p disagg <verb>`: `config` with the .env written so far (the build in
    section 2 used to fail here: GRAFANA_ADMIN_PASSWORD is required and .env came in section 6)."""
    assert re.match(r"^docker compose -f docker/compose.yaml -p disagg ", cmd), f"v2 syntax, one file: {cmd}"
    assert (repo / "docker/.env").is_file(), f"{cmd}: docker/.env is not written yet"
    exe = shutil.which("docker-compose")
    r = subprocess.run([exe, "-f", "docker/compose.yaml", "-p", "disagg", "config"], cwd=repo, capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, (cmd, r.stderr)
    assert "GF_SECURITY_ADMIN_PASSWORD" in r.stdout


def test_commands_split_as_pasted():
    cmds = _split(["a \\", "--b c   # note", "# only a comment", "cat > x <<EOF", "K=1", "EOF", "d"])
    assert cmds == ["a  --b c", "cat > x <<EOF\nK=1\nEOF", "d"]


TINY = ROOT / ".disagg" / "site" / "models" / "gpt-oss-tiny"  # `make site-models`: gpt_oss, MXFP4 experts as published


@pytest.mark.skipif(not (TINY / "config.json").is_file(), reason="needs `make site-models` (the tiny gpt_oss)")
def test_gpt_oss_mac_commands_run_as_written(tmp_path):
    """Section 4's gpt-oss commands, as pasted, on a tiny checkpoint in the official format (MXFP4 experts,
    quant_method mxfp4) for openai/gpt-oss-120b and a temporary folder for /opt/disagg: mlx-lm's converter with
    the guide's flags, then `models prepare --mlx ... --against` with the fingerprint spark-1 printed (the prefill
    side's, computed from its own folder here), and a wrong fingerprint refused."""
    from kv_bridge.fingerprint import model_fingerprint

    cmds = commands(GUIDE.read_text())
    convert = next(c for c in cmds if "mlx_lm.convert" in c)
    prepare = next(c for c in cmds if "--model gpt-oss:120b" in c and "--mlx" in c)
    opt = tmp_path / "opt"
    (opt / "downloads").mkdir(parents=True)
    (opt / "config.toml").write_text((ROOT / "examples" / "site.toml").read_text().replace("/opt/disagg", str(opt)))
    local = (convert.replace("/opt/disagg/.venv/bin/", f"{Path(sys.executable).parent}/")
             .replace("/opt/disagg", str(opt)).replace("openai/gpt-oss-120b", str(TINY)))
    r = subprocess.run(["bash", "-euc", local], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (local, r.stdout, r.stderr)
    assert '"mode": "mxfp4"' in (opt / "downloads" / "gpt-oss-120b-mlx" / "config.json").read_text()
    spark1 = model_fingerprint(str(TINY.with_name("gpt-oss-tiny-vllm")))
    for fp, ok in (("0" * 16, False), (spark1, True)):
        words = prepare.replace('"$SPARK1_FP"', fp).replace("/opt/disagg", str(opt)).split()
        r = disagg(*words[1:], cwd=tmp_path)
        assert "Traceback" not in r.stderr, r.stderr
        if ok:
            assert r.returncode == 0 and "fingerprints agree" in r.stdout, r.stdout + r.stderr
            assert "mlx" in r.stdout and "mxfp4" in r.stdout.lower()
        else:
            assert r.returncode == 1 and "fingerprints differ" in r.stderr, r.stdout + r.stderr
