"""What tests, bench/ and `make site` share: fake nodes, the real stack, tiny models, oracles and the helpers more
than one test module uses. Imported as a package from the repository root (`tests.support.fakes`); it imports no
test module."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root

# Before anything here or in a test imports mlx: MLX's matmuls on OpenBLAS, as a decode node's (backends/host_blas.py),
# so an in-process reference computes as the nodes it is compared with do.
from backends.host_blas import prefer_openblas  # noqa: E402

prefer_openblas()
