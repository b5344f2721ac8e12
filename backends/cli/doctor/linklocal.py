"""`disagg doctor`'s link-local checks (the seeds' four machines on one switch, 169.254.0.0/16): a second interface
holding an address of the same /16 (a Mac's Thunderbolt Bridge assigns itself one), and the interface the route to
each peer takes (`ip route get` / `route -n get`: a lookup, no packet sent)."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys

from backends.cli.doctor import host
from backends.cli.doctor.checks import FAIL, PASS, WARN, Check, Ctx

LINK_LOCAL = ipaddress.IPv4Network("169.254.0.0/16")
TB_FIX = ("macOS: System Settings > Network > Thunderbolt Bridge > Details > TCP/IP > Configure IPv4: Off (or "
          "remove the Thunderbolt Bridge service); Linux: ip addr del ADDRESS dev IFACE")


def parse_ip_route_get(text: str) -> tuple[str | None, str | None]:
    """(interface, source) of `ip -o route get ADDR` ("169.254.150.101 dev enP7s7 src 169.254.150.103 uid 0")."""
    dev, src = re.search(r"\bdev (\S+)", text), re.search(r"\bsrc (\S+)", text)
    return (dev.group(1) if dev else None), (src.group(1) if src else None)


def parse_route_get(text: str) -> tuple[str | None, str | None]:
    """(interface, None) of macOS `route -n get ADDR` ("   interface: en0")."""
    m = re.search(r"^\s*interface:\s*(\S+)", text, re.M)
    return (m.group(1) if m else None), None


def route_to(addr: str) -> tuple[str | None, str | None]:
    """(interface, source address) this machine would use for `addr`: the routing table's answer, else the source
    a UDP connect picks (either way nothing is sent)."""
    cmd, parse = (["route", "-n", "get", addr], parse_route_get) if sys.platform == "darwin" else \
        (["ip", "-o", "route", "get", addr], parse_ip_route_get)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        dev, src = parse(r.stdout) if r.returncode == 0 else (None, None)
    except OSError:
        dev, src = None, None
    if dev is None:
        src = host.route_source(addr, 9)
        i = host.interface_of(src) if src else None
        dev = i.name if i else None
    return dev, src


def own_addresses(ctx: Ctx) -> list[str]:
    """The addresses the config gives this machine: its node's host and kv_host, or the gateway's."""
    if ctx.node is None:
        return [ctx.settings.gateway.reach_host()]
    return [a for a in (ctx.node.host, ctx.node.kv_host) if a]


def peers(ctx: Ctx) -> dict[str, str]:
    """Who this machine talks to, by name -> address: the gateway reaches every node; a prefill node sends KV to each
    decode node of its models; every node answers the gateway."""
    s = ctx.settings
    if ctx.node is None:
        return {n.name: n.host for n in s.nodes}
    out = {"gateway": s.gateway.reach_host()}
    if ctx.node.role == "prefill":
        out |= {d: s.node(d).kv_target["host"] for m in ctx.models() for d in m.decode}
    return out


def _link_local(addr: str) -> bool:
    try:
        return ipaddress.IPv4Address(addr) in LINK_LOCAL
    except ValueError:
        return False


def check_link_local(ctx: Ctx, ifaces: list[host.Interface] | None = None, route=route_to) -> list[Check]:
    """Nothing (no line) unless the config puts this machine or a peer on 169.254.0.0/16."""
    mine = own_addresses(ctx)
    others = {k: v for k, v in peers(ctx).items() if k != (ctx.node.name if ctx.node else "gateway")}
    if not any(_link_local(a) for a in [*mine, *others.values()]):
        return []
    ifaces = host.interfaces() if ifaces is None else ifaces
    holders = [i for i in ifaces if i.network.ip in LINK_LOCAL]
    home = next((i for i in ifaces if str(i.network.ip) in mine), None)
    out = []
    if len({i.name for i in holders}) > 1:
        names = ", ".join(f"{i.name} {i.network}" for i in holders)
        out.append(Check("link-local", FAIL, f"{len(holders)} interfaces hold 169.254.0.0/16 addresses ({names}): "
                         f"traffic to a peer's 169.254 address may leave by the wrong one",
                         f"keep one: {TB_FIX}"))
    elif home is not None:
        out.append(Check("link-local", PASS, f"only {home.name} holds a 169.254.0.0/16 address ({home.network})"))
    for name, addr in sorted(others.items()):
        if not _link_local(addr) or addr in mine:  # a peer on this very machine (the gateway on a Spark)
            continue
        dev, src = route(addr)
        text = f"{addr} leaves by {dev or '?'}" + (f" from {src}" if src else "")
        if dev is None:
            out.append(Check(f"route to {name}", FAIL, f"{addr}: no route from this machine",
                             f"give the switch's interface an address in 169.254.0.0/16 ({mine[0]})"))
        elif home is not None and dev != home.name:
            out.append(Check(f"route to {name}", FAIL, f"{text}, not {home.name} (which holds {home.network.ip})",
                             f"the other interface claims 169.254.0.0/16: {TB_FIX}"))
        elif src is not None and src not in mine:
            out.append(Check(f"route to {name}", WARN, f"{text}, not from this machine's configured {mine[0]}",
                             "the peer sees another source address: keyless networks and firewall rules key on it"))
        else:
            out.append(Check(f"route to {name}", PASS, text))
    return out
