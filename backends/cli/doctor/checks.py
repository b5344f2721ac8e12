"""`disagg doctor`'s shared parts: a check's line, one run's context, and the checks every role runs (Python, the
role's packages), used by backends/cli/doctor/report.py and backends/cli/doctor/engines.py alike."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings

PASS, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
GIB = 2**30


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<4}  {self.name}: {self.detail}" + (f"; fix: {self.fix}" if self.fix else "")


@dataclass
class Ctx:
    """One doctor run: the config, the node (None: the gateway box), and every /health that answered."""

    settings: Settings
    config: Path
    node: NodeConfig | None
    answers: dict  # name ("gateway" or a node's) -> host.Answer | None

    @property
    def role(self) -> str:
        return self.node.role if self.node else "gateway"

    @property
    def base(self) -> Path:
        return self.config.resolve().parent

    @property
    def running(self) -> bool:
        a = self.answers.get(self.node.name if self.node else "gateway")
        return a is not None and a.status == 200

    def models(self):
        if self.node is None:
            return list(self.settings.models)
        return [m for m in self.settings.models if self.node.name in getattr(m, self.role)]


# ---- checks every role runs ----

def check_python() -> Check:
    v = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info >= (3, 11):
        return Check("python", PASS, f"{v} at {sys.executable} (3.11+ needed)")
    return Check("python", FAIL, f"{v} at {sys.executable}; the project needs 3.11+",
                 "brew install python@3.12 and rerun docker/install-mac.sh (macOS's python3 is 3.9); on Linux use "
                 "the images")


def _requirements(extra: str) -> list:
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        reqs = metadata.requires("disagg") or []
    except metadata.PackageNotFoundError:
        import tomllib

        proj = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]
        reqs = proj["dependencies"] + [f"{r}; extra == '{extra}'" for r in proj["optional-dependencies"][extra]]
    out = []
    for r in map(Requirement, reqs):
        if r.marker is None or r.marker.evaluate({"extra": extra}):
            out.append(r)
    return out


def check_packages(extra: str) -> Check:
    """The role's extra (and the base dependencies) installed at versions pyproject.toml accepts."""
    from importlib import metadata

    bad, have = [], []
    for r in _requirements(extra):
        try:
            v = metadata.version(r.name)
        except metadata.PackageNotFoundError:
            bad.append(f"{r.name} missing")
            continue
        if r.specifier and not r.specifier.contains(v, prereleases=True):
            bad.append(f"{r.name} {v} is not {r.specifier}")
        have.append(f"{r.name} {v}")
    name = f"packages [{extra}]"
    if bad:
        fix = "rerun docker/install-mac.sh" if extra == "decode" else f"pip install -e '.[{extra}]' (or the image)"
        return Check(name, FAIL, "; ".join(bad), fix)
    return Check(name, PASS, ", ".join(have))
