"""What `disagg doctor` reads of the machine it runs on: memory, network interfaces (address, MTU), ports, a Mac's
chip and macOS, and other machines' /health over HTTP (answer, Date header). Facts only; backends/cli/doctor/report.py judges."""

from __future__ import annotations

import email.utils
import errno
import fcntl
import ipaddress
import json
import platform
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30


@dataclass
class Answer:
    """One GET: its status and JSON body, and the server's clock (Date) against ours at the request's midpoint."""

    status: int
    body: dict
    offset_s: tuple[float, float] | None  # (lowest, highest) server - local: Date has whole seconds


def http_get(url: str, headers: dict | None = None, timeout: float = 2.0) -> Answer | None:
    """None when nothing answers (refused, timeout); any HTTP status otherwise."""
    req = urllib.request.Request(url, headers=headers or {})
    t0 = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, date = r.status, r.read(), r.headers.get("Date")
    except urllib.error.HTTPError as e:
        status, raw, date = e.code, e.read(), e.headers.get("Date")
    except (OSError, ValueError):
        return None
    mid = (t0 + time.time()) / 2
    try:
        body = json.loads(raw)
    except ValueError:
        body = {}
    offset = None
    if date:
        server = email.utils.parsedate_to_datetime(date).timestamp()
        offset = (server - mid, server + 1 - mid)
    return Answer(status, body if isinstance(body, dict) else {}, offset)


def memory() -> tuple[float, float] | None:
    """(available, total) GiB: Linux's MemAvailable / MemTotal, a Mac's free + inactive + purgeable pages; None
    where neither can be read."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=10).stdout
            total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True,
                                       timeout=10).stdout)
        except (OSError, ValueError, subprocess.SubprocessError):
            return None
        page = int(re.search(r"page size of (\d+)", out).group(1))
        pages = {k.strip(): int(v.strip(" .")) for k, v in re.findall(r"^(Pages [^:]+):\s+(\d+)", out, re.M)}
        free = sum(pages.get(k, 0) for k in ("Pages free", "Pages inactive", "Pages purgeable"))
        return free * page / GIB, total / GIB
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kib = {k: int(v.split()[0]) for k, v in info.items() if k in ("MemAvailable", "MemTotal")}
        return kib["MemAvailable"] / 2**20, kib["MemTotal"] / 2**20
    except (OSError, KeyError, ValueError):
        return None


def mac_facts() -> tuple[str, str]:
    """(chip, macOS version) of this Mac."""
    chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                          timeout=10).stdout.strip()
    return chip or platform.machine(), platform.mac_ver()[0]


# ---- network ----

@dataclass
class Interface:
    name: str
    network: ipaddress.IPv4Interface  # its address with the prefix: 10.10.0.21/24
    mtu: int | None


def parse_ifconfig(text: str) -> list[Interface]:
    """macOS `ifconfig`: a block per interface, `en0: flags=... mtu 1500`, then `inet A netmask 0xffffff00` lines."""
    out, name, mtu = [], None, None
    for line in text.splitlines():
        head = re.match(r"^(\S+): flags=\S+.*?mtu (\d+)", line)
        if head:
            name, mtu = head.group(1), int(head.group(2))
            continue
        inet = re.match(r"^\s+inet (\d+\.\d+\.\d+\.\d+) netmask 0x([0-9a-f]{8})", line)
        if inet and name:
            prefix = bin(int(inet.group(2), 16)).count("1")
            out.append(Interface(name, ipaddress.IPv4Interface(f"{inet.group(1)}/{prefix}"), mtu))
    return out


def _linux_interfaces() -> list[Interface]:
    """Each interface's primary IPv4 address and netmask (SIOCGIFADDR / SIOCGIFNETMASK), MTU from /sys/class/net."""
    out = []
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891B, req)[20:24])
            except OSError:  # no IPv4 address
                continue
            try:
                mtu = int(Path(f"/sys/class/net/{name}/mtu").read_text())
            except (OSError, ValueError):
                mtu = None
            out.append(Interface(name, ipaddress.IPv4Interface(f"{addr}/{mask}"), mtu))
    finally:
        s.close()
    return out


def interfaces() -> list[Interface]:
    if sys.platform == "darwin":
        try:
            return parse_ifconfig(subprocess.run(["ifconfig"], capture_output=True, text=True, timeout=10).stdout)
        except OSError:
            return []
    return _linux_interfaces()


def interface_of(addr: str, ifaces: list[Interface] | None = None) -> Interface | None:
    """The interface that holds `addr` (its own address first, else the one whose network contains it: 127.0.3.21
    is lo's on Linux)."""
    ifaces = interfaces() if ifaces is None else ifaces
    try:
        ip = ipaddress.IPv4Address(addr)
    except ValueError:
        return None
    return next((i for i in ifaces if i.network.ip == ip), None) or \
        next((i for i in ifaces if ip in i.network.network), None)


def resolve(host: str) -> str | None:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except OSError:
        return None


def is_local(addr: str) -> bool:
    """This machine can listen on `addr` (binding it succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((addr, 0))
            return True
        except OSError:
            return False


def route_source(addr: str, port: int) -> str | None:
    """The local address this machine would send from to reach `addr` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, port))
            return s.getsockname()[0]
        except OSError:
            return None


def port_state(host: str, port: int) -> str:
    """"free", "busy" (something holds it) or "not-local" (this machine has no such address). Bound the way the
    nodes bind (SO_REUSEADDR), so a stopped node's TIME_WAIT connections do not count as busy."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
            return "free"
        except OSError as e:
            return "not-local" if e.errno == errno.EADDRNOTAVAIL else "busy"
