"""Benchmarks (not tests): each prints ratios against a baseline measured in the same run. Run from the repository
root as modules, `.venv/bin/python -m bench.bench_x`; they import the repository's packages and tests.support."""

from backends.host_blas import prefer_openblas  # noqa: E402  (before any bench imports mlx: backends/host_blas.py)

prefer_openblas()
