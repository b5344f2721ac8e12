"""The prefill image's build-time check (gpu_arch --build) run as `docker build` runs it: under a torch whose CUDA is
compiled in but which sees no GPU (no device, no driver; on a GPU machine the GPU is hidden). Needs such a torch's
interpreter in $DISAGG_CUDA_PYTHON: `make test-cuda-build` makes one (PyPI's CUDA torch, ~2.6 GB of wheels), `make
test-gpu` passes the GPU machine's own. The reference is torch's own record of its nvcc flags (torch.__config__)."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[4]  # the checkout, or /opt/disagg-src in the prefill image (no tests.support)
PYTHON = os.environ.get("DISAGG_CUDA_PYTHON")
needs_cuda_torch = pytest.mark.skipif(not PYTHON, reason="needs a CUDA-compiled torch's python in "
                                      "$DISAGG_CUDA_PYTHON: make test-cuda-build")
# What the check runs with: this tree's code, no visible GPU (a docker build has none).
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
TARGET = {"x86_64": "amd64", "aarch64": "arm64"}[platform.machine()]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def torch_build() -> dict:
    """That torch as it sees itself: its CUDA version, whether a device is visible, and the archs its nvcc flags
    name (`-gencode arch=compute_90,code=sm_90`, torch.__config__.show()): the reference, recorded by its build."""
    out = run("-c", "import json, torch; print(json.dumps({'cuda': torch.version.cuda, 'available': "
              "torch.cuda.is_available(), 'config': torch.__config__.show()}))")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout.splitlines()[-1])
    facts["archs"] = sorted(set(re.findall(r"code=((?:sm|compute)_\d+a?)", facts["config"])))
    return facts


@needs_cuda_torch
def test_the_torch_is_cuda_compiled_and_sees_no_device(torch_build):
    assert torch_build["cuda"] is not None, f"{PYTHON} has a CPU torch: the test needs PyPI's CUDA build"
    assert torch_build["available"] is False
    assert torch_build["archs"], "torch.__config__ names no -gencode flags"


def _torch_line(out: subprocess.CompletedProcess) -> str:
    (line,) = [ln for ln in (out.stdout + out.stderr).splitlines() if "torch kernels:" in ln]
    return line


@needs_cuda_torch
def test_build_check_reads_the_compiled_archs_without_a_device(torch_build):
    """GB10 (12.1): ok when the build carries an sm_12x cubin (sm_120 runs on 12.1), named; else the failure."""
    sm12 = [a for a in torch_build["archs"] if re.fullmatch(r"sm_12\d", a) and int(a[-1]) <= 1]
    out = run("-m", "backends.cli.doctor.gpu_arch", "--build", "--target-arch", TARGET, "--capability", "12.1")
    line = _torch_line(out)
    if sm12:
        assert line.startswith("prefill image: ok    torch kernels:") and ", ".join(sm12) in line, line
    else:
        assert "FAIL  torch kernels:" in line and "no kernels for sm_121" in line, line


@needs_cuda_torch
def test_build_check_fails_for_a_gpu_the_build_lacks_and_names_what_it_has(torch_build):
    """A GPU older than the oldest arch the build carries (CUDA 13 builds dropped Volta, 7.0): exit 1, the message
    lists every arch compiled in, and the fix."""
    oldest = min(int(a.split("_")[1].rstrip("a")) for a in torch_build["archs"])
    major = oldest // 10 if oldest % 10 else oldest // 10 - 1
    out = run("-m", "backends.cli.doctor.gpu_arch", "--build", "--target-arch", TARGET, "--capability", f"{major}.0")
    assert out.returncode == 1
    line = _torch_line(out)
    assert f"has no kernels for sm_{major}0: it carries" in line, line
    assert set(line.split("it carries ", 1)[1].split(", ")) == set(torch_build["archs"])
    assert "Fix: a vLLM built for CUDA 13" in out.stderr
