"""`disagg config check`'s look at docker/ beside the config: every port the compose file publishes or probes and every
Prometheus target, against the config's gateway ports and [[nodes]]; and the firewall lines derived from the config."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kv_bridge.config.settings import Settings

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_docker(s: Settings, folder: Path) -> tuple[list[str], list[str]]:
    """(errors, warnings) of docker/compose.yaml and docker/prometheus/prometheus.yml in `folder` against `s`."""
    errors: list[str] = []
    try:
        compose = yaml.safe_load((folder / "compose.yaml").read_text())
        prom = yaml.safe_load((folder / "prometheus" / "prometheus.yml").read_text())
    except (OSError, yaml.YAMLError) as e:
        return [f"{folder}: cannot read the compose file or Prometheus config: {e}"], []
    services = compose.get("services") or {}
    gw = services.get("gateway") or {}
    errors += _gateway_service(s, gw, folder / "compose.yaml")
    host_net = {name: svc.get("network_mode") == "host" for name, svc in services.items()}
    errors2, warnings = _prometheus(s, prom, host_net, folder / "prometheus" / "prometheus.yml")
    return errors + errors2, warnings


def published(ports: list) -> dict[int, int]:
    """compose `ports:` entries ("8000:8000", "0.0.0.0:11434:11434/tcp", "8000") as {container port: host port}."""
    out = {}
    for entry in ports:
        if isinstance(entry, dict):  # the long syntax
            out[int(entry["target"])] = int(entry.get("published", entry["target"]))
            continue
        parts = str(entry).split("/")[0].split(":")
        out[int(parts[-1])] = int(parts[-2]) if len(parts) > 1 else int(parts[-1])
    return out


def _gateway_service(s: Settings, gw: dict, where: Path) -> list[str]:
    errors = []
    ports = s.gateway.ports()
    names = {s.gateway.port: "gateway.port", s.gateway.ollama_port: "gateway.ollama_port"}
    env = gw.get("environment") or {}
    env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else env
    for var, value in (("DISAGG_GATEWAY__PORT", s.gateway.port), ("DISAGG_GATEWAY__OLLAMA_PORT", s.gateway.ollama_port)):
        if var in env and str(env[var]) != str(value):
            errors.append(f"{where}: the gateway's environment sets {var}={env[var]} but the config says {value}: "
                          f"the container would listen elsewhere; drop {var} (the config decides)")
    if gw.get("network_mode") == "host":
        if gw.get("ports"):
            errors.append(f"{where}: the gateway has network_mode: host and ports: (Docker refuses both); drop ports:")
    else:
        pub = published(gw.get("ports") or [])
        for p in ports:
            if p not in pub:
                errors.append(f"{where}: the gateway listens on {p} ({names[p]}) but the compose file does not "
                              f"publish it (ports: {sorted(f'{h}:{c}' for c, h in pub.items()) or 'none'}): clients "
                              f"get 'connection refused'; add \"{p}:{p}\" under services.gateway.ports or use "
                              f"network_mode: host (docs/deploy.md)")
            elif pub[p] != p:
                errors.append(f"{where}: the gateway's {names[p]} {p} is published on the host as {pub[p]}: clients, "
                              f"the guide and doctor use {p}; publish \"{p}:{p}\"")
        if s.auth.keyless_networks:
            errors.append(f"{where}: auth.keyless_networks needs the client's own address, but the gateway is "
                          f"published through Docker's port mapping (its userland proxy shows clients as the bridge's "
                          f"address); give the gateway network_mode: host (docs/security.md, keyless clients)")
    test = " ".join(map(str, (gw.get("healthcheck") or {}).get("test") or []))
    for port in map(int, re.findall(r"(?:localhost|127\.0\.0\.1|\]|gateway):(\d+)", test)):
        if port not in ports:
            errors.append(f"{where}: the gateway's health check probes port {port}, which the config does not listen "
                          f"on ({ports}): the container turns unhealthy; use `python -m gateway --probe` (it reads "
                          f"the config)")
    return errors


def _prometheus(s: Settings, prom: dict, host_net: dict, where: Path) -> tuple[list[str], list[str]]:
    errors, warnings = [], []
    jobs = {job.get("job_name"): job for job in prom.get("scrape_configs") or []}
    gw_targets = [t for sc in (jobs.get("disagg-gateway") or {}).get("static_configs") or [] for t in sc["targets"]]
    if not gw_targets:
        errors.append(f"{where}: no disagg-gateway target: nothing scrapes the gateway")
    for target in gw_targets:
        host, _, port = target.rpartition(":")
        ok_hosts = ({"gateway"} if not host_net.get("gateway") else set()) | (
            {*LOOPBACK, s.gateway.reach_host(), s.gateway.host} if host_net.get("prometheus") else
            {s.gateway.reach_host(), "host.docker.internal"})
        if int(port) not in s.gateway.ports():
            errors.append(f"{where}: Prometheus scrapes the gateway at {target}, but it listens on "
                          f"{s.gateway.ports()}: write {s.gateway.reach_host()}:{s.gateway.port}")
        elif host not in ok_hosts:
            errors.append(f"{where}: Prometheus scrapes the gateway at {target}, which it cannot reach with the "
                          f"compose file's networking; write one of {sorted(ok_hosts)} with port {port}")
    seen = {}
    for name, job in jobs.items():
        for sc in job.get("static_configs") or []:
            node = (sc.get("labels") or {}).get("node")
            if node:
                seen[node] = (name, sc["targets"])
    for n in s.nodes:
        want = (f"disagg-{n.role}", [f"{n.host}:{n.port}"])
        if n.name not in seen:
            errors.append(f"{where}: node {n.name} ({n.host}:{n.port}) is not scraped: add it under job "
                          f"disagg-{n.role} with labels {{node: {n.name}}}")
        elif seen[n.name] != want:
            errors.append(f"{where}: node {n.name} is scraped at {seen[n.name][1]} ({seen[n.name][0]}) but the "
                          f"config says {want[1][0]} ({want[0]})")
    extra = sorted(set(seen) - {n.name for n in s.nodes})
    if extra:
        warnings.append(f"{where}: Prometheus scrapes nodes the config does not have: {extra}")
    return errors, warnings


def gateway_machine(s: Settings) -> str | None:
    """The [[nodes]] name whose machine the gateway shares (its advertised address is that node's), else None."""
    host = s.gateway.reach_host()
    return next((n.name for n in s.nodes if n.host == host or n.kv_host == host), None)


def firewall(s: Settings) -> list[str]:
    """ufw lines for each Linux machine (the prefill nodes and the gateway's machine), from the config's ports."""
    gw_at = gateway_machine(s)
    gw_from = s.gateway.reach_host()
    if gw_from in LOOPBACK:
        gw_from = "GATEWAY_ADDRESS"  # a wildcard host without gateway.advertise_host: the box's own address
    where = f"gateway ({'on ' + gw_at if gw_at else s.gateway.reach_host()})"
    lines = [f"  {where}: " + "; ".join(f"sudo ufw allow {p}/tcp" for p in s.gateway.ports())
             + "  (clients: keys, or auth.keyless_networks" + (f" {[str(n) for n in s.auth.keyless_networks]}"
                                                              if s.auth.keyless_networks else "") + ")"]
    lines.append(f"  {where}: sudo ufw allow from ADMIN_NET to any port 9090,3000 proto tcp  (Prometheus, Grafana)")
    # `disagg status` from a Mac probes the prefill nodes too (docs/deploy.md): the decode machines may reach them
    macs = sorted({n.host for n in s.nodes if n.role == "decode" and n.host not in LOOPBACK and n.host != gw_from})
    for n in s.nodes:
        if n.role == "prefill":
            lines.append(f"  {n.name}: sudo ufw allow OpenSSH  (first, before `ufw enable`: it keeps your SSH session)")
            lines.append(f"  {n.name}: sudo ufw allow from {gw_from} to any port {n.port} proto tcp  (gateway -> "
                         f"prefill HTTP{', local on this machine' if n.name == gw_at else ''})")
            lines += [f"  {n.name}: sudo ufw allow from {m} to any port {n.port} proto tcp  (`disagg status` from "
                      f"that Mac)" for m in macs]
    return lines
