"""A decode machine's memory against Metal's GPU wired limit (macOS `iogpu.wired_limit_mb`): the one comparison the
decode node makes at start and `disagg doctor` reports. What the node needs is config check's budget
(backends/cli/config_check.py); this module only reads the limit and compares."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings
from kv_bridge.config.source import ConfigError

GIB = 2**30
DAEMON = "/Library/LaunchDaemons/com.disagg.wired-limit.plist"  # docker/install-mac.sh: the limit at every boot


def _sysctl(name: str) -> str:
    return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, check=True, timeout=10).stdout


@dataclass
class WiredLimit:
    """What Metal may wire: the sysctl's value, or macOS's default when it is 0 (the value after every boot)."""

    set_mb: int  # iogpu.wired_limit_mb as read (0: the default)
    total_bytes: int  # hw.memsize

    @property
    def bytes(self) -> int:
        if self.set_mb > 0:
            return self.set_mb * 2**20
        # macOS's default (Metal's recommendedMaxWorkingSetSize): about 3/4 of RAM above 36 GiB, 2/3 at or below
        return int(self.total_bytes * (0.75 if self.total_bytes > 36 * GIB else 2 / 3))

    def describe(self) -> str:
        how = f"iogpu.wired_limit_mb = {self.set_mb}" if self.set_mb else \
            "iogpu.wired_limit_mb = 0: the macOS default, about 75% of RAM"
        return f"{self.bytes / GIB:.1f} GiB of {self.total_bytes / GIB:.0f} GiB ({how})"


def wired_limit(sysctl: Callable[[str], str] = _sysctl, platform: str = sys.platform) -> WiredLimit | None:
    """The Mac's wired limit; None on any other OS (no such limit: Linux has no Metal)."""
    if platform != "darwin":
        return None
    return WiredLimit(int(sysctl("iogpu.wired_limit_mb").strip() or 0), int(sysctl("hw.memsize").strip()))


def decode_need(settings: Settings, node: NodeConfig, config: Path):
    """config check's memory budget of one decode node: [(what, GiB)] and the models whose weight size is unknown
    here. The arithmetic is decode_budget's (config check's too), not repeated."""
    from backends.decode.budget import decode_budget

    routes = [m for m in settings.models if node.name in m.decode]
    d = decode_budget(settings, node, routes, Path(config).resolve().parent)
    return d.items, d.unknown


def recommended_mb(total_bytes: int, reserved_gib: float) -> int:
    """The limit install-mac.sh sets: all the RAM but what config check keeps for macOS (reserved_gib, default 8)."""
    return int((total_bytes / GIB - reserved_gib) * 1024)


def fit(settings: Settings, node: NodeConfig, config: Path, limit: WiredLimit) -> tuple[bool, str]:
    """(fits, one line): the node's budget against the wired limit; when it does not fit, the line names the sysctl
    to set (or, when even that is too little, what to lower)."""
    parts, unknown = decode_need(settings, node, config)
    need = sum(g for _, g in parts)
    what = ", ".join(f"{w} {g:.1f}" for w, g in parts)
    more = f"; weight size of {unknown} unknown (no folder here, no decode_weights_gib)" if unknown else ""
    line = f"needs {need:.1f} GiB ({what}){more} under Metal's wired limit of {limit.describe()}"
    if need * GIB <= limit.bytes:
        return True, line
    rec = recommended_mb(limit.total_bytes, node.reserved("decode"))
    if need * 1024 <= rec:
        fix = (f"sudo sysctl iogpu.wired_limit_mb={rec} (docker/install-mac.sh installs {DAEMON}, which sets it at "
               f"every boot)")
    else:
        fix = ("lower [decode] prefix_cache_bytes or mlx_cache_limit_bytes, [kv] max_inflight_bytes or pool_bytes, or "
               f"serve fewer models on it: even iogpu.wired_limit_mb={rec} (all but reserved_gib "
               f"{node.reserved('decode'):g}) is too little")
    return False, f"{line}; fix: {fix}"


def check_decode_start(settings: Settings, node: NodeConfig, config: Path, **kw) -> None:
    """At decode start on a Mac: refuse (ConfigError) when the configured models and their KV budget do not fit
    under the wired limit; Metal would otherwise fail or swap mid-request. Elsewhere: nothing to check."""
    limit = wired_limit(**kw)
    if limit is None:
        return
    ok, line = fit(settings, node, config, limit)
    if not ok:
        raise ConfigError(f"decode node {node.name!r} {line}")
