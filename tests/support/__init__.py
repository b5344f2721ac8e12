"""What tests, bench/ and `make site` share: fake nodes, the real stack, tiny models, oracles and the helpers more
than one test module uses. Imported as a package from the repository root (`tests.support.fakes`); it imports no
test module."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
