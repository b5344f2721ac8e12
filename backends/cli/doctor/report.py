"""`disagg doctor --config F --node NAME`: what one machine needs before it serves, one line per check (pass, warn,
fail with the fix, or skipped with why); exit status 1 on any failure. `--node gateway` checks the gateway box.

Checks that need the machine (engines, Metal, memory, interfaces) are in backends/cli/doctor/engines.py; facts of the
host in backends/cli/doctor/host.py. Nothing here starts an engine.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from backends.cli.doctor import host
from backends.cli.procenv import user_name
from kv_bridge.config.models import resolve_model_path
from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings
from kv_bridge.config.source import ConfigError
from kv_bridge.keys import is_loopback

from backends.cli.doctor.checks import FAIL, GIB, PASS, SKIP, WARN, Check, Ctx, check_packages, check_python  # noqa: F401


def gateway_url(s: Settings) -> str:
    return s.gateway.url()  # advertise_host, host, or loopback for a wildcard host


def probe_all(s: Settings, timeout: float) -> dict:
    """GET /health of the gateway and every node at once (with the node token where the secret is readable)."""
    try:
        token = s.auth.node_token()
    except ConfigError:
        token = None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    keys = []
    try:
        keys = s.auth.client_keys()
    except ConfigError:
        pass
    urls = {"gateway": (gateway_url(s) + "/health", {"Authorization": f"Bearer {keys[0]}"} if keys else {})}
    urls |= {n.name: (n.url + "/health", headers) for n in s.nodes}
    with ThreadPoolExecutor(len(urls)) as pool:
        futures = {k: pool.submit(host.http_get, u, h, timeout) for k, (u, h) in urls.items()}
        return {k: f.result() for k, f in futures.items()}


# ---- model folders, secrets, ports, clock, other nodes ----

def check_models(ctx: Ctx) -> list[Check]:
    from backends.cli import checkpoints
    from kv_bridge.fingerprint import model_fingerprint, model_quantization

    out = []
    for m in ctx.models():
        role = ctx.role
        folder = resolve_model_path(m, ctx.base, role)
        name = f"model {m.id}"
        prep = f"disagg models prepare --config {ctx.config} --model {m.id}" + (
            f" --role {role} --hf <hub id or folder>" if role == "gateway" else
            f" --role {role} ..." if Path(m.path).is_absolute() else "")
        if not (folder / "config.json").is_file():
            out.append(Check(name, FAIL, f"no model folder at {os.path.normpath(folder)} (no config.json)", prep + " (docs/deploy.md)"))
            continue
        problems = _gateway_problems(folder) if role == "gateway" else checkpoints.check_hf(folder)
        if problems:
            out.append(Check(name, FAIL, f"{folder}: {'; '.join(problems)}", prep))
            continue
        fp = model_fingerprint(str(folder))
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / GIB
        facts = f"{os.path.normpath(folder)}, {model_quantization(folder)}, {size:.1f} GiB, fingerprint {fp}"
        out.append(_compare(ctx, m, name, facts, fp, role, size))
    return out


def _gateway_problems(folder: Path) -> list[str]:
    missing = [n for n in ("tokenizer.json",) if not (folder / n).is_file()]
    cfg = folder / "tokenizer_config.json"
    if not (folder / "chat_template.jinja").is_file() and not (cfg.is_file() and "chat_template" in cfg.read_text()):
        missing.append("a chat template")
    return [f"no {m}" for m in missing]


def _compare(ctx: Ctx, m, name: str, facts: str, fp: str, role: str, size: float) -> Check:
    """The folder's fingerprint against the gateway's copy (where this machine has it) and every running node of
    the model; its size against the size config check budgets with."""
    others = {}
    gw = resolve_model_path(m, ctx.base)
    if role != "gateway" and (gw / "config.json").is_file() and gw.resolve() != resolve_model_path(
            m, ctx.base, role).resolve():
        from kv_bridge.fingerprint import model_fingerprint

        others["the gateway's copy"] = model_fingerprint(str(gw))
    for n in ctx.settings.nodes:
        a = ctx.answers.get(n.name)
        if n is not ctx.node and a is not None and a.status == 200 and m.id in (a.body.get("fingerprint") or {}):
            others[n.name] = a.body["fingerprint"][m.id]
    bad = sorted(k for k, v in others.items() if v != fp)
    if bad:
        return Check(name, FAIL, f"{facts} differs from {', '.join(f'{k} ({others[k]})' for k in bad)}",
                     "prepare both sides from the same checkpoint (disagg models prepare ... --against); KV "
                     "handshakes refuse a mismatch")
    declared = m.prefill_weights_gib if role == "prefill" else m.decode_weights_gib if role == "decode" else None
    if declared and size and abs(size - declared) > 0.1 * declared:
        return Check(name, WARN, f"{facts}; [[models]] {role}_weights_gib says {declared:g}",
                     f"set {role}_weights_gib = {size:.1f} so config check budgets this machine right")
    if others:
        agree = f"; agrees with {', '.join(sorted(others))}"
    elif role == "gateway":
        agree = "; no node of it answered to compare with"
    else:
        agree = "; not compared (no other node of it answered; the gateway box's doctor compares each node with its copy)"
    return Check(name, PASS, facts + agree)


def check_secrets(ctx: Ctx) -> list[Check]:
    """Each secret file this machine reads: present, owned by the user running this (the role's user), 0600."""
    a = ctx.settings.auth
    files = [("auth.node_secret_file", a.node_secret_file)]
    if ctx.node is None:
        files.append(("auth.api_keys_file", a.api_keys_file))
    out = []
    for field, path in files:
        if path is None:
            if field == "auth.node_secret_file" and a.node_secret is None:
                local = all(is_loopback(n.host) for n in ctx.settings.nodes)
                out.append(Check("node secret", PASS if local else WARN, "none: nodes run open" +
                                 (" (every node on loopback)" if local else ""),
                                 "" if local else "set auth.node_secret_file (docs/deploy.md step 2)"))
            continue
        p = Path(os.path.normpath(path if path.is_absolute() else ctx.base / path))
        out.append(_secret_file(field, p, a))
    return out


def _secret_file(field: str, p: Path, auth) -> Check:
    me = user_name()  # "uid N" where the image has no passwd entry (docker run -u UID:GID)
    try:
        st = p.stat()
    except OSError as e:
        make = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'" if "node" in field else \
            "python3 -c 'import secrets; print(\"sk-\" + secrets.token_urlsafe(24))'"
        return Check(field, FAIL, f"{p}: {e.strerror}", f"{make} > {p}; chmod 600 {p} (the same node secret on "
                     f"every machine)" if "node" in field else f"{make} > {p}; chmod 600 {p}")
    owner = _user(st.st_uid)
    mode = st.st_mode & 0o777
    if st.st_uid != os.geteuid():
        how = "; you are root: run doctor as the user that runs the role" if os.geteuid() == 0 else ""
        return Check(field, FAIL, f"{p} is owned by {owner}, this role runs as {me}{how}", f"sudo chown {me} {p}")
    if mode & 0o077:
        return Check(field, FAIL, f"{p} has mode {mode:04o}: other users can read it", f"chmod 600 {p}")
    try:
        auth.secret() if "node" in field else auth.client_keys()
    except ConfigError as e:
        return Check(field, FAIL, str(e), f"write a valid one into {p}")
    return Check(field, PASS, f"{p}: owned by {owner}, mode {mode:04o}")


def _user(uid: int) -> str:
    return user_name(uid)


def check_ports(ctx: Ctx) -> list[Check]:
    s, n = ctx.settings, ctx.node
    if n is None:
        ports = [("gateway port", s.gateway.host, s.gateway.port)]
        if s.gateway.ollama_port:  # Ollama's own port: a plain Ollama still running here holds it
            ports.append(("gateway ollama_port", s.gateway.host, s.gateway.ollama_port))
    else:
        ports = [("HTTP port", n.host, n.port)]
        if n.role == "decode":
            ports.append(("KV port", n.kv_host or n.host, n.kv_port))
    out = []
    for what, h, port in ports:
        state = host.port_state("0.0.0.0" if h in ("0.0.0.0", "") else h, port)
        where = f"{h}:{port}"
        if state == "free":
            out.append(Check(what, PASS, f"{where} free"))
        elif state == "not-local":
            out.append(Check(what, SKIP, f"{where}: not an address of this machine (see the address check)")
                       if what == "KV port" else
                       Check(what, FAIL, f"{where}: {h} is not an address of this machine",
                             f"run this on the machine with {h}, or fix its host in the config"))
        elif ctx.running:
            out.append(Check(what, PASS, f"{where} in use by this {ctx.role} (running: /health answers)"))
        else:
            out.append(Check(what, FAIL, f"{where} is busy and /health does not answer there",
                             f"stop what listens on it (lsof -nP -iTCP:{port} -sTCP:LISTEN, or "
                             f"ss -ltnp 'sport = :{port}') or give this node another port in the config"))
    return out


def check_clock(ctx: Ctx) -> Check:
    """Our clock against the gateway's Date header (else a node's); Date has whole seconds, so only a skew that
    lies beyond 1 s whichever way it is rounded warns."""
    me = ctx.node.name if ctx.node else "gateway"
    order = ["gateway"] + [n.name for n in ctx.settings.nodes]
    for name in order:
        a = ctx.answers.get(name)
        if name == me or a is None or a.offset_s is None:
            continue
        lo, hi = a.offset_s
        skew = 0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi))
        text = f"{skew:.1f} s from {name}'s (Date header, whole seconds)"
        if skew > 1.0:
            return Check("clock", WARN, text, "turn on NTP on both (timedatectl set-ntp true; macOS: System "
                         "Settings > General > Date & Time)")
        return Check("clock", PASS, f"within 1 s of {name}'s")
    return Check("clock", SKIP, "no other machine answered to compare with (run doctor again once they are up)")


def check_nodes(ctx: Ctx) -> list[Check]:
    """On the gateway box: every node's /health answers (through the firewall, with the node token)."""
    out = []
    for n in ctx.settings.nodes:
        a = ctx.answers.get(n.name)
        if a is not None and a.status == 200:
            out.append(Check(f"reach {n.name}", PASS, f"{n.url}/health answers ({n.role})"))
        elif a is not None:
            out.append(Check(f"reach {n.name}", FAIL, f"{n.url}/health answers HTTP {a.status}: "
                             f"{(a.body.get('error') or {}).get('message') or a.body}",
                             "read its log; 401: the node secret differs between the gateway box and it"))
        else:
            out.append(Check(f"reach {n.name}", FAIL, f"{n.url}/health does not answer",
                             f"start it (docs/deploy.md step 5), or open port {n.port} from this box in its firewall"))
    return out


# ---- the run ----

def run(settings: Settings, config: Path, name: str, timeout: float = 2.0) -> list[Check]:
    from backends.cli.doctor import engines, linklocal

    node = None if name == "gateway" else _node(settings, name)
    ctx = Ctx(settings, Path(config), node, probe_all(settings, timeout))
    checks = [check_python()]
    if ctx.role == "prefill":
        checks += engines.prefill(ctx)
    elif ctx.role == "decode":
        checks += engines.decode(ctx)
    else:
        checks.append(check_packages("gateway"))
    checks += check_models(ctx) + check_secrets(ctx) + check_ports(ctx) + engines.network(ctx)
    checks += linklocal.check_link_local(ctx)  # the seeds' 169.254 switch: one interface on it, routes through it
    checks.append(check_clock(ctx))
    if node is None:
        checks += check_nodes(ctx)
    return checks


def _node(settings: Settings, name: str) -> NodeConfig:
    try:
        return settings.node(name)
    except ConfigError as e:
        raise ConfigError(f"{e}; or --node gateway for the gateway box") from None


def main(settings: Settings, config: Path, name: str, timeout: float = 2.0) -> int:
    checks = run(settings, config, name, timeout)
    for c in checks:
        print(c.line())
    failed = sum(c.status == FAIL for c in checks)
    print(f"{name}: {len(checks)} checks, {failed} failed" + ("" if failed else ", ready to serve"))
    return 1 if failed else 0
