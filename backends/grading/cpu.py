"""The one-machine term of a grading prediction: when every node runs on this machine (`make site`, a test stack),
they share its cores, and the cost model's per-node speeds (each measured alone) hold only while the nodes' CPU use
fits in them. How much CPU a busy node costs the machine is measured, not fitted: the machine's CPU seconds
(/proc/stat: every role's processes, vLLM's engine cores, the gateway and the link relays included) over each
calibration call, against the seconds that call computed (its prefill and its decode). `shared`, how many nodes run
at their measured speed at once, is the cores over that use; the cost model stretches the timeline wherever more are
busy (backends/grading/predict.py, `shared_makespan`).
"""

from __future__ import annotations

import ipaddress
import os

from kv_bridge.config.settings import Settings


def one_machine(settings: Settings) -> bool:
    """Every node on a loopback address: one machine runs them all."""
    def loopback(host: str) -> bool:
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    return bool(settings.nodes) and all(loopback(n.host) for n in settings.nodes)


def cores() -> int:
    """The cores this process may run on (a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def machine_cpu_seconds(stat: str = "/proc/stat") -> float | None:
    """CPU seconds this machine has spent busy since boot, all cores (None where there is no /proc/stat: macOS)."""
    try:
        with open(stat) as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def shared(cpu_s: float, busy_s: float, n_cores: int) -> tuple[float | None, float | None]:
    """(how many nodes run at their measured speed at once, the CPU a busy node costs per second) from calibration
    calls that spent `cpu_s` CPU seconds over `busy_s` seconds of computing; (None, None) when nothing was measured."""
    if cpu_s <= 0 or busy_s <= 0:
        return None, None
    use = cpu_s / busy_s
    return n_cores / use, use
