"""The GPU kernel checks with fakes (no GPU here): torch's compiled arch list against a GB10's compute capability
12.1, a vLLM kernel probe's outcomes, and the prefill image's build-time check of machine, vLLM wheel and torch."""

from __future__ import annotations

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
    assert c.status == FAIL and "sm_90" in c.detail and "cu130" in c.fix and "docs/deploy.md" in c.fix


def test_ptx_only_warns():
    c = gpu_arch.check_torch(GB10, ["sm_90", "compute_90"])
    assert c.status == WARN and "PTX" in c.detail


def test_vllm_probe_outcomes():
    assert gpu_arch.check_vllm(lambda: None, GB10).status == PASS
    bad = gpu_arch.check_vllm(lambda: "RuntimeError: CUDA error: no kernel image is available for execution on the "
                              "device", GB10)
    assert bad.status == FAIL and "sm_121" in bad.detail and "cu130" in bad.fix
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
