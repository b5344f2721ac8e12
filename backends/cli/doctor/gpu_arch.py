"""Do the installed torch and vLLM carry kernels for this GPU (a GB10 is compute capability 12.1, sm_121)? `disagg
doctor` on a prefill node, and the prefill image's build (`python -m backends.cli.doctor.gpu_arch --build`: the
machine, the vLLM wheel's platform and torch's CUDA build agree, before the image exists, with no GPU in sight)."""

from __future__ import annotations

import argparse
import platform
import re
import sys
from typing import Callable

from backends.cli.doctor.checks import FAIL, PASS, WARN, Check

VENV_FIX = ("a vLLM built with this GPU's kernels: the prefill image on NVIDIA's PyTorch base "
            "(--build-arg BASE=nvcr.io/nvidia/pytorch:25.11-py3 --build-arg WITH_VLLM=1), or the venv route in "
            "docs/deploy.md section 3 (PyPI's vllm-0.32.0-cp38-abi3-manylinux_2_28_aarch64.whl and the torch it pins)")
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


def compiled_arch_list(torch) -> list[str]:
    """The CUDA archs `torch` was compiled for ('sm_90', 'compute_120'), [] for a CPU build. Read from the build
    itself (`torch._C._cuda_getArchFlags`, a compile-time string), never from `torch.cuda.get_arch_list()`: before
    pytorch/pytorch#180356 (April 2026) that answered [] whenever no device was visible, as in a `docker build`."""
    flags = getattr(torch._C, "_cuda_getArchFlags", None)  # absent from a CPU build
    return (flags() or "").split() if flags is not None else []


def checks() -> list[Check]:
    """On a CUDA machine: torch's compiled arch list against the device, then one vLLM kernel run on it."""
    import torch

    cap = torch.cuda.get_device_capability(0)
    out = [check_torch(cap, compiled_arch_list(torch), torch.cuda.get_device_name(0))]
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


def build_checks(machine: str, target: str | None, vllm_platforms: list[str], torch_cuda: str | None,
                 arch_list: list[str], capability: tuple[int, int]) -> list[Check]:
    """One line each for the machine, the vLLM wheel and torch's kernels: is the image fit for the GPU, from facts
    alone (no device needed)."""
    want = ARCH_NAMES.get(target or "", machine)
    if ARCH_NAMES.get(machine, machine) != want:
        plat = Check("platform", FAIL, f"building for {target} but running on {machine}: the base image has no "
                     f"linux/{target} build (docker pulled another platform)")
    else:
        plat = Check("platform", PASS, f"{machine}" + (f" (target {target})" if target else ""))
    if not vllm_platforms:
        wheel = Check("vllm wheel", FAIL, "vLLM is not installed from a wheel here (no WHEEL tag): cannot tell its "
                      "platform")
    elif not any(p.endswith(want) for p in vllm_platforms):
        wheel = Check("vllm wheel", FAIL, f"the installed vLLM wheel is for {', '.join(vllm_platforms)}, not {want}")
    else:
        wheel = Check("vllm wheel", PASS, ", ".join(vllm_platforms))
    sm = f"sm_{capability[0]}{capability[1]}"
    kind, entries = kernels_for(capability, arch_list)
    if torch_cuda is None:
        kern = Check("torch kernels", FAIL, "torch is a CPU build (torch.version.cuda is None)")
    elif kind == "none":
        kern = Check("torch kernels", FAIL, f"torch (CUDA {torch_cuda}) has no kernels for {sm}: it carries "
                     f"{', '.join(arch_list) or 'none'}")
    else:
        kern = Check("torch kernels", PASS if kind == "native" else WARN, f"torch (CUDA {torch_cuda}) has {entries} "
                     f"for {sm}" + ("" if kind == "native" else ": PTX only, compiled at every start"))
    return [plat, wheel, kern]


def build_problems(machine: str, target: str | None, vllm_platforms: list[str], torch_cuda: str | None,
                   arch_list: list[str], capability: tuple[int, int]) -> list[str]:
    """What makes an image unfit for the Spark: the failing lines of build_checks."""
    return [c.detail for c in build_checks(machine, target, vllm_platforms, torch_cuda, arch_list, capability)
            if c.status == FAIL]


def parse_capability(text: str) -> tuple[int, int]:
    """'12.1' -> (12, 1); anything else (an empty `--build-arg CUDA_CAPABILITY=`) is refused with the fix."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a compute capability MAJOR.MINOR (a GB10 is 12.1, an H100 9.0; `nvidia-smi "
            f"--query-gpu=compute_cap --format=csv` on the GPU's machine); with docker build, leave out "
            f"--build-arg CUDA_CAPABILITY (default 12.1) or give it a value")
    return int(m.group(1)), int(m.group(2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="check an image's vLLM and torch for the target machine and GPU")
    p.add_argument("--build", action="store_true", help="at image build time (no GPU)")
    p.add_argument("--target-arch", default=None, help="Docker's TARGETARCH (arm64, amd64)")
    p.add_argument("--capability", type=parse_capability, default=(12, 1), metavar="MAJOR.MINOR",
                   help="the GPU's compute capability (GB10: 12.1)")
    args = p.parse_args(argv)
    import torch

    found = build_checks(platform.machine(), args.target_arch or None, wheel_platforms("vllm"), torch.version.cuda,
                         compiled_arch_list(torch), args.capability)
    failed = any(c.status == FAIL for c in found)
    for c in found:
        print("prefill image: " + c.line(), file=sys.stderr if failed else sys.stdout)
    if failed:
        print(f"prefill image: not fit for sm_{args.capability[0]}{args.capability[1]}. Fix: {VENV_FIX}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
