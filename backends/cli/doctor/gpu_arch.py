"""Do the installed torch and vLLM carry kernels for this GPU (a GB10 is compute capability 12.1, sm_121)? `disagg
doctor` on a prefill node, and the prefill image's build (`python -m backends.cli.doctor.gpu_arch --build`: the
machine, the vLLM wheel's platform and torch's CUDA build agree, before the image exists)."""

from __future__ import annotations

import argparse
import platform
import re
import sys
from typing import Callable

from backends.cli.doctor.checks import FAIL, PASS, WARN, Check

VENV_FIX = ("a vLLM built for CUDA 13 with this GPU's kernels: the prefill image on a CUDA 13 arm64 base "
            "(--build-arg BASE=... --build-arg WITH_VLLM=1), or the venv route in docs/deploy.md section 3 "
            "(vLLM's aarch64 +cu130 wheel, torch from https://download.pytorch.org/whl/cu130)")
ARCH_NAMES = {"arm64": "aarch64", "aarch64": "aarch64", "amd64": "x86_64", "x86_64": "x86_64"}


def parse_arch(entry: str) -> tuple[str, int, int, str] | None:
    """'sm_121' -> ('sm', 12, 1, ''); 'compute_90' -> ('compute', 9, 0, ''); 'sm_90a' -> ('sm', 9, 0, 'a')."""
    m = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", entry)
    return (m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)) if m else None


def kernels_for(capability: tuple[int, int], arch_list: list[str]) -> tuple[str, str]:
    """("native" | "ptx" | "none", the entries that serve it). A cubin for sm_XY runs on X.Z with Z >= Y (same
    major; an arch-specific sm_XYa only on X.Y itself); PTX for compute_XY is compiled at load for any capability
    >= X.Y (slow first start)."""
    major, minor = capability
    native, ptx = [], []
    for e in arch_list:
        p = parse_arch(e)
        if p is None:
            continue
        kind, maj, mi, suffix = p
        if kind == "sm" and maj == major and (mi == minor if suffix == "a" else mi <= minor):
            native.append(e)
        elif kind == "compute" and (maj, mi) <= (major, minor):
            ptx.append(e)
    if native:
        return "native", ", ".join(native)
    return ("ptx", ", ".join(ptx)) if ptx else ("none", "")


def check_torch(capability: tuple[int, int], arch_list: list[str], name: str = "this GPU") -> Check:
    cc = f"{capability[0]}.{capability[1]} (sm_{capability[0]}{capability[1]})"
    kind, entries = kernels_for(capability, arch_list)
    have = ", ".join(arch_list) or "none"
    if kind == "native":
        return Check("torch kernels", PASS, f"{name} is compute capability {cc}; torch has {entries}")
    if kind == "ptx":
        return Check("torch kernels", WARN, f"{name} is compute capability {cc}; torch has only PTX for it "
                     f"({entries}): compiled at every start, slower", f"install {VENV_FIX}")
    return Check("torch kernels", FAIL, f"{name} is compute capability {cc}; torch carries kernels for {have} only",
                 f"install {VENV_FIX}")


def check_vllm(probe: Callable[[], str | None], capability: tuple[int, int]) -> Check:
    """`probe` runs one of vLLM's own CUDA kernels on the device: None when it ran, else the error's text."""
    err = probe()
    if err is None:
        return Check("vllm kernels", PASS, f"vLLM's CUDA kernels run on sm_{capability[0]}{capability[1]}")
    if "no kernel image" in err or "invalid device function" in err:
        return Check("vllm kernels", FAIL, f"vLLM has no kernels for sm_{capability[0]}{capability[1]}: {err[:120]}",
                     f"install {VENV_FIX}")
    return Check("vllm kernels", WARN, f"could not run a vLLM kernel to check: {err[:160]}")


def probe_vllm_rms_norm() -> str | None:
    """vLLM's rms_norm custom op on a tiny tensor on cuda:0 (the kernel every model runs)."""
    try:
        import torch
        from vllm import _custom_ops as ops

        x = torch.ones(1, 64, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(x)
        ops.rms_norm(out, x, torch.ones(64, dtype=torch.bfloat16, device="cuda"), 1e-6)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # a missing kernel image, or an API this vLLM names differently: both reported
        return f"{type(e).__name__}: {e}"


def checks() -> list[Check]:
    """On a CUDA machine: torch's compiled arch list against the device, then one vLLM kernel run on it."""
    import torch

    cap = torch.cuda.get_device_capability(0)
    out = [check_torch(cap, torch.cuda.get_arch_list(), torch.cuda.get_device_name(0))]
    if out[0].status != FAIL:
        out.append(check_vllm(probe_vllm_rms_norm, cap))
    return out


# ---- at image build time (no GPU there) ----

def wheel_platforms(dist: str) -> list[str]:
    """The platform tags of an installed distribution's WHEEL file ('manylinux_2_35_aarch64'), [] when unknown."""
    from importlib import metadata

    try:
        text = metadata.distribution(dist).read_text("WHEEL") or ""
    except metadata.PackageNotFoundError:
        return []
    return [line.split(":", 1)[1].strip().rsplit("-", 1)[-1] for line in text.splitlines() if line.startswith("Tag:")]


def build_problems(machine: str, target: str | None, vllm_platforms: list[str], torch_cuda: str | None,
                   arch_list: list[str], capability: tuple[int, int]) -> list[str]:
    """What makes an image unfit for the Spark, from facts alone (tested with fakes)."""
    problems = []
    want = ARCH_NAMES.get(target or "", machine)
    if ARCH_NAMES.get(machine, machine) != want:
        problems.append(f"building for {target} but running on {machine}: the base image has no linux/{target} "
                        f"build (docker pulled another platform)")
    if not vllm_platforms:
        problems.append("vLLM is not installed from a wheel here (no WHEEL tag): cannot tell its platform")
    elif not any(p.endswith(want) for p in vllm_platforms):
        problems.append(f"the installed vLLM wheel is for {', '.join(vllm_platforms)}, not {want}")
    if torch_cuda is None:
        problems.append("torch is a CPU build (torch.version.cuda is None)")
    elif kernels_for(capability, arch_list)[0] == "none":
        problems.append(f"torch (CUDA {torch_cuda}) has no kernels for sm_{capability[0]}{capability[1]}: it carries "
                        f"{', '.join(arch_list) or 'none'}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="check an image's vLLM and torch for the target machine and GPU")
    p.add_argument("--build", action="store_true", help="at image build time (no GPU)")
    p.add_argument("--target-arch", default=None, help="Docker's TARGETARCH (arm64, amd64)")
    p.add_argument("--capability", default="12.1", help="the GPU's compute capability (GB10: 12.1)")
    args = p.parse_args(argv)
    import torch

    cap = tuple(int(x) for x in args.capability.split("."))
    problems = build_problems(platform.machine(), args.target_arch or None, wheel_platforms("vllm"),
                              torch.version.cuda, torch.cuda.get_arch_list(), cap)
    if problems:
        print("prefill image: " + "; ".join(problems) + f". Fix: {VENV_FIX}", file=sys.stderr)
        return 1
    print(f"prefill image: {platform.machine()}, vLLM wheel {', '.join(wheel_platforms('vllm'))}, torch CUDA "
          f"{torch.version.cuda} with {kernels_for(cap, torch.cuda.get_arch_list())[1]} for sm_{cap[0]}{cap[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
