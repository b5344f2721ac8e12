"""`disagg config check FILE`: validate a site config, budget each machine's memory and disk, and print what each
machine will run. Errors (the config cannot work) exit 2; warnings name what this machine cannot see (secrets,
model folders, sizes)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kv_bridge.config.models import ModelRoute, resolve_model_path
from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings
from kv_bridge.config.source import ConfigError
from kv_bridge.keys import is_loopback

from backends.decode import budget as decode_budget

GIB = 2**30

# How each role starts on the seed site (docs/deploy.md): the flags the prefill image needs, the Mac install script.
PREFILL_RUN = ("docker run -d --name disagg-prefill --restart unless-stopped --gpus all --network host --ipc=host "
               "-v /opt/disagg:/opt/disagg:ro -e DISAGG_CONFIG=/opt/disagg/config.toml {mounts}"
               "-v disagg-cache:/root/.cache disagg-prefill --node {name}")
DECODE_RUN = "docker/install-mac.sh {name}  (launchd com.disagg.decode: disagg decode --node {name})"
GATEWAY_RUN = "docker compose -f docker/compose.yaml -p disagg up -d --build"
LOWER = ("lower [decode] prefix_cache_bytes or mlx_cache_limit_bytes, [kv] max_inflight_bytes or pool_bytes, serve "
         "fewer models on it (examples/site-paired.toml: one model per Mac), or give it more memory")


@dataclass
class Report:
    machines: list[dict] = field(default_factory=list)  # one per gateway / node: what runs there
    budgets: list = field(default_factory=list)  # a Budget per node that states memory_gib
    kv_capacity: list[dict] = field(default_factory=list)  # per model whose folder is here: KV a decode node holds
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    firewall: list[str] = field(default_factory=list)  # ufw lines per Linux machine, from the config's ports

    def to_json(self) -> dict:
        return {"machines": self.machines, "errors": self.errors, "warnings": self.warnings, "firewall": self.firewall,
                "budgets": [{"node": b.node, "memory_gib": dict(b.memory), "available_gib": b.available_gib,
                             "disk_gib": dict(b.disk), "disk_available_gib": b.disk_gib, "notes": b.notes,
                             "grading_capacity": b.capacity} for b in self.budgets],
                "kv_capacity": self.kv_capacity}


def check(settings: Settings, config: Path, docker: Path | None = None) -> Report:
    """Everything the pydantic schema cannot see alone: each machine's role, addresses, models and the cross checks;
    with `docker` (a folder), its compose file and Prometheus targets against the config (backends/cli/deploy_check.py)."""
    rep = Report()
    rep.machines.append(_gateway(settings))
    for node in settings.nodes:
        rep.machines.append(_node(settings, node))
    _check_auth(settings, rep)
    _check_addresses(settings, rep)
    _check_models(settings, config, rep)
    _check_prefill_memory(settings, rep)
    rep.budgets = budgets(settings, config, rep.errors, rep.warnings)
    _check_docker(settings, docker, rep)
    return rep


def _check_docker(s: Settings, docker: Path | None, rep: Report) -> None:
    from backends.cli import deploy_check

    rep.firewall = deploy_check.firewall(s)
    if docker is None and (Path("docker") / "compose.yaml").is_file():
        docker = Path("docker")  # run from the repository root, as the guide does
    if docker is None:
        rep.warnings.append("docker/compose.yaml not here: run from the repository root (or pass --docker DIR) to "
                            "check the compose file's ports and the Prometheus targets against this config")
        return
    errors, warnings = deploy_check.check_docker(s, docker)
    rep.errors += errors
    rep.warnings += warnings


def _gateway(s: Settings) -> dict:
    models = {m.id: m.aliases for m in s.models}
    run = "disagg gateway" if is_loopback(s.gateway.host) else GATEWAY_RUN
    listen = ", ".join(f"{h}:{p}" for h, p in s.gateway.listen())
    return {"machine": listen, "role": "gateway", "name": "gateway", "run": run, "http": s.gateway.url(),
            "ollama": s.gateway.url(ollama=True) if s.gateway.ollama_port else None, "kv": "-", "models": models}


def _node(s: Settings, node: NodeConfig) -> dict:
    pool = "prefill" if node.role == "prefill" else "decode"
    models = {m.id: {"max_model_len": m.max_model_len} for m in s.models if node.name in getattr(m, pool)}
    if node.role == "prefill":
        # the model folders are mounted at the paths the config names (real folders: a symlink would dangle inside)
        paths = [Path(m.path) for m in s.models if node.name in m.prefill and Path(m.path).is_absolute()]
        dirs = {str(p.parent) for p in paths if not str(p).startswith("/opt/disagg/")}
        dirs |= {str(p.resolve()) for p in paths if p.is_symlink()}  # a linked checkpoint: mount where it points
        dirs = sorted(dirs)
        mounts = "".join(f"-v {d}:{d}:ro " for d in dirs)
        run, kv = PREFILL_RUN.format(mounts=mounts, name=node.name), "sends"
    else:
        run = DECODE_RUN.format(name=node.name)
    if is_loopback(node.host):
        run = f"disagg {node.role} --node {node.name}  (all roles at once: disagg up)"
    if node.role == "decode":
        t = node.kv_target
        kv = f"listens {node.kv_host or node.host}:{node.kv_port}, prefill sends to {t['host']}:{t['port']}"
    return {"machine": node.host, "role": node.role, "name": node.name, "run": run, "http": node.url, "kv": kv,
            "models": models}


def _check_auth(s: Settings, rep: Report) -> None:
    for node in s.nodes:
        try:
            s.auth.check_node_exposure(node)
        except ConfigError as e:
            rep.errors.append(str(e))
    if not is_loopback(s.gateway.host) and not (s.auth.api_keys or s.auth.api_keys_file):
        rep.warnings.append(f"the gateway listens on {s.gateway.host} with no auth.api_keys: any client on the "
                            f"network can use it")
    where = {"auth.node_secret_file": "the gateway box and every node", "auth.api_keys_file": "the gateway box"}
    for what, fn in (("auth.node_secret_file", s.auth.secret), ("auth.api_keys_file", s.auth.client_keys)):
        try:
            fn()
        except ConfigError as e:  # the files live on the machines, not necessarily where the check runs
            rep.warnings.append(f"{e} (it must exist on {where[what]}, readable by the process that runs there)")


def _check_addresses(s: Settings, rep: Report) -> None:
    # a wildcard gateway holds its ports on its machine's own address too (a Spark it shares with a node)
    seen: dict[tuple[str, int], str] = {(h, p): "gateway" for h, p in s.gateway.listen()}
    seen |= {(s.gateway.reach_host(), p): "gateway" for p in s.gateway.ports()}
    for node in s.nodes:
        ports = [(node.host, node.port, "HTTP")]
        if node.kv_port is not None:
            ports.append((node.kv_host or node.host, node.kv_port, "KV"))
        for host, port, what in ports:
            other = seen.get((host, port))
            if other is not None:
                rep.errors.append(f"{node.name} {what} {host}:{port} is also {other}'s; give one of them another port")
            seen[(host, port)] = f"{node.name} {what}"
        if node.role == "prefill" and (node.kv_port or node.kv_host):
            rep.warnings.append(f"{node.name}: kv_port/kv_host are decode settings; a prefill node only sends KV")
    for node in s.nodes:
        if not any(node.name in (*m.prefill, *m.decode) for m in s.models):
            rep.warnings.append(f"node {node.name!r} serves no model: add it to a [[models]] prefill/decode list")


def _check_models(s: Settings, config: Path, rep: Report) -> None:
    from kv_bridge.dtypes import target_itemsize
    from kv_bridge.fingerprint import config_kv_dtype, kv_bytes_per_token, model_fingerprint, model_quantization
    from gateway.text.output import check_parsers  # the gateway's start-up check: its parser registries

    for m in s.models:
        try:
            check_parsers([m])
        except ConfigError as e:
            rep.errors.append(str(e))
        if m.max_model_len > s.kv.max_tokens:
            rep.errors.append(f"model {m.id!r}: max_model_len {m.max_model_len} > kv.max_tokens {s.kv.max_tokens}; "
                              f"raise kv.max_tokens")
        if not m.prefill:
            rep.warnings.append(f"model {m.id!r} has no prefill node: every prompt is prefilled on the decode node")
        folder = resolve_model_path(m, config.resolve().parent)
        if not (folder / "config.json").is_file():
            rep.warnings.append(f"model {m.id!r}: no config.json at {folder} here (fine where this machine runs no "
                                f"node of it; `disagg models prepare` builds it on the machines that do)")
            continue
        # A decode node reserves and holds KV in the model's dtype (config.json's; the node measures it at load)
        dtype = config_kv_dtype(folder)
        held = kv_bytes_per_token(folder, target_itemsize(dtype))
        need = held * m.max_model_len
        if need > s.kv.max_transfer_bytes:
            rep.errors.append(f"model {m.id!r}: a full context's KV is {need / 2**30:.1f} GiB > kv.max_transfer_bytes "
                              f"{s.kv.max_transfer_bytes / 2**30:.1f} GiB; raise it or lower max_model_len")
        full = held * (m.max_model_len - 1)  # what a decode node reserves for a full-context transfer
        rep.kv_capacity.append({"model": m.id, "dtype": dtype, "bytes_per_token": held, "max_model_len":
                                m.max_model_len, "full_context_gib": round(full / GIB, 3),
                                "full_context_in_flight": s.kv.max_inflight_bytes // full})
        if m.decode and full > s.kv.max_inflight_bytes:
            rep.errors.append(f"model {m.id!r}: a full-context prompt's KV is {full / GIB:.2f} GiB as {dtype} > "
                              f"kv.max_inflight_bytes {s.kv.max_inflight_bytes / GIB:.2f} GiB: every decode node "
                              f"would refuse it (429); raise kv.max_inflight_bytes or lower max_model_len")
        for mach in rep.machines:
            if m.id in mach["models"] and isinstance(mach["models"][m.id], dict):
                mach["models"][m.id].update(fingerprint=model_fingerprint(str(folder)),
                                            quantization=model_quantization(folder))


def _check_prefill_memory(s: Settings, rep: Report) -> None:
    for node in s.nodes:
        n = sum(1 for m in s.models if node.name in m.prefill)
        if n > 1 and n * s.prefill.gpu_memory_utilization > 1.0:
            rep.errors.append(f"prefill node {node.name!r} runs {n} vLLM engines at gpu_memory_utilization "
                              f"{s.prefill.gpu_memory_utilization} each ({n * s.prefill.gpu_memory_utilization:.2f} "
                              f"of the GPU); give each model its own prefill node or lower it below {1 / n:.2f}")


# ---- memory and disk budget, one machine at a time ----

@dataclass
class Budget:
    node: str
    memory: list[tuple[str, float]]  # (what, GiB)
    available_gib: float | None
    disk: list[tuple[str, float]]
    disk_gib: float | None
    notes: list[str] = field(default_factory=list)  # where the figures came from (measured, declared, published)
    capacity: list[dict] = field(default_factory=list)  # decode: grading prompts per model at once

    def memory_of(self, what: str) -> float:
        return next((g for w, g in self.memory if w == what), 0.0)

    def line(self) -> str:
        need = sum(g for _, g in self.memory)
        have = "?" if self.available_gib is None else f"{self.available_gib:.1f}"
        parts = " + ".join(f"{what} {g:.1f}" for what, g in self.memory)
        lines = [f"  {self.node}: memory {need:.1f} of {have} GiB ({parts})"] + [f"    {n}" for n in self.notes]
        for c in self.capacity:
            lines.append(f"    {c['model']}: {c['at_once']} at once of {c['tokens']}-token grading prompts "
                         f"({c['reserved_gib']:.2f} GiB reserved each, {c['dtype']}, every layer at full length: "
                         f"{c['by_kv']} by in-flight KV, max_batch_size {c['max_batch']}; "
                         f"{c['held_gib']:.2f} GiB held once decoding)")
        if len(self.capacity) > 1:  # the node's models share its in-flight KV
            both, bound = sum(c["reserved_gib"] for c in self.capacity), self.memory_of("in-flight KV")
            lines.append(f"    one of each model at once: {both:.2f} GiB reserved of the in-flight {bound:.2f}: "
                         f"{'fits' if both <= bound else 'does not fit'}")
        return "\n".join(lines)


def weights_gib(route: ModelRoute, role: str, base: Path) -> float | None:
    """The side's folder measured where it is here, else its declared size (decode_budget.weights says which)."""
    from backends.decode.budget import weights

    return weights(route, role, base)[0]


def budgets(s: Settings, config: Path, errors: list[str], warnings: list[str]) -> list[Budget]:
    """One Budget per node that states memory_gib; errors for a machine over its RAM or disk."""
    base, out = config.resolve().parent, []
    for node in s.nodes:
        pool = "prefill" if node.role == "prefill" else "decode"
        routes = [m for m in s.models if node.name in getattr(m, pool)]
        if node.memory_gib is None:
            warnings.append(f"{node.name}: no memory_gib in its [[nodes]] entry, so its memory is not budgeted")
            continue
        sizes = {m.id: weights_gib(m, node.role, base) for m in routes}
        unknown = [mid for mid, g in sizes.items() if g is None]
        if unknown:
            warnings.append(f"{node.name}: weight size of {unknown} unknown here: set {pool}_weights_gib in [[models]]")
        known = [(f"{mid} weights", g) for mid, g in sizes.items() if g is not None]
        if node.role == "decode":
            b = _decode(s, node, routes, base, errors)
        else:
            b = _prefill(s, node, routes, sizes, errors)
            b.notes = [f"{r.id} weights: {decode_budget.weights(r, 'prefill', base)[1]}" for r in routes]
        b.disk, b.disk_gib = [(what.replace(" weights", ""), g) for what, g in known], node.disk_gib
        _check_disk(b, errors)
        out.append(b)
    return out


def _decode(s: Settings, node: NodeConfig, routes: list[ModelRoute], base: Path, errors: list[str]) -> Budget:
    """Mac: decode_budget's items (weights, prefix caches, in-flight KV, pool, local prefill, MLX cache, process,
    session) against its RAM less what macOS keeps."""
    d = decode_budget.decode_budget(s, node, routes, base)
    avail = node.memory_gib - node.reserved("decode")
    b = Budget(node.name, d.items, avail, [], None, d.notes, decode_budget.grading_capacity(s, node, routes, base))
    need, margin = sum(g for _, g in d.items), decode_budget.HEADROOM_GIB
    if need > avail:
        errors.append(f"decode node {node.name!r} needs {need:.1f} GiB ({', '.join(f'{w} {g:.1f}' for w, g in d.items)}"
                      f") but has {avail:.1f} GiB ({node.memory_gib:g} GiB less {node.reserved('decode'):g} reserved "
                      f"for macOS): {need - avail:.1f} GiB over; {LOWER}")
    elif avail - need < margin:
        errors.append(f"decode node {node.name!r} needs {need:.1f} of its {avail:.1f} GiB: {avail - need:.1f} GiB "
                      f"headroom, under the {margin:g} GiB margin every Mac keeps for what the budget estimates "
                      f"(docs/deploy.md \"The Mac's memory budget\"); {LOWER}")
    return b


def _prefill(s: Settings, node: NodeConfig, routes: list[ModelRoute], sizes: dict, errors: list[str]) -> Budget:
    """Spark: vLLM asks for gpu_memory_utilization x total per engine and refuses to start when that exceeds what
    is free at start-up; each engine's share must hold its weights."""
    util, total = s.prefill.gpu_memory_utilization, node.memory_gib
    free = total - node.reserved("prefill")
    mem = [(f"vLLM {r.id}", util * total) for r in routes]
    b = Budget(node.name, mem, free, [], None)
    asked = util * total * len(routes)
    if asked > free:
        fit = int(free / total / max(len(routes), 1) * 100) / 100
        errors.append(f"prefill node {node.name!r}: vLLM asks for gpu_memory_utilization {util} x {total:g} GiB"
                      f"{f' x {len(routes)} engines' if len(routes) > 1 else ''} = {asked:.1f} GiB, but about "
                      f"{free:.1f} GiB is free at start ({total:g} less {node.reserved('prefill'):g} the OS and page "
                      f"cache keep): vLLM refuses to start; set [prefill] gpu_memory_utilization <= {fit}")
    for r in routes:
        w = sizes.get(r.id)
        if w is not None and w >= util * total:
            errors.append(f"prefill node {node.name!r}: {r.id} weights {w:.1f} GiB do not fit its vLLM share of "
                          f"{util * total:.1f} GiB (no room for KV blocks); raise gpu_memory_utilization or use a "
                          f"smaller checkpoint")
    return b


def _check_disk(b: Budget, errors: list[str]) -> None:
    need = sum(g for _, g in b.disk)
    if b.disk_gib is not None and need > b.disk_gib:
        errors.append(f"node {b.node!r}: its model folders take {need:.1f} GiB "
                      f"({', '.join(f'{w} {g:.1f}' for w, g in b.disk)}) but disk_gib is {b.disk_gib:g}; free disk "
                      f"or move [[models]] path to a larger volume")

def render(rep: Report, settings: Settings) -> str:
    """The plan as terminal tables (machines, models, how to start each), then errors and warnings."""
    rows = [("NAME", "ROLE", "HTTP", "KV", "MODELS")]
    for m in rep.machines:
        kv = m["kv"] if m["role"] != "decode" else "<- " + m["kv"].split("prefill sends to ")[-1]
        rows.append((m["name"], m["role"], m["http"].removeprefix("http://"), kv, ", ".join(m["models"]) or "-"))
    lines = _table(rows) + ["", "MODEL / ALIASES / CONTEXT / PREFILL -> DECODE"]
    for r in settings.models:
        facts = next((v for mach in rep.machines for k, v in mach["models"].items()
                      if k == r.id and isinstance(v, dict) and "fingerprint" in v), None)
        extra = f"  fingerprint {facts['fingerprint']} ({facts['quantization']})" if facts else ""
        lines.append(f"  {r.id}  [{', '.join(r.aliases) or 'no aliases'}]  {r.max_model_len} tokens  "
                     f"{', '.join(r.prefill) or '(none)'} -> {', '.join(r.decode)}{extra}")
    if rep.budgets:
        lines += ["", "MEMORY (GiB)"] + [b.line() for b in rep.budgets]
    if rep.kv_capacity:
        lines += ["", f"KV IN FLIGHT PER DECODE NODE (kv.max_inflight_bytes {settings.kv.max_inflight_bytes / GIB:.2f} "
                  f"GiB, held in the model's dtype)"]
        lines += [f"  {c['model']}: {c['bytes_per_token'] / 1024:g} KiB/token ({c['dtype']}); a full context "
                  f"({c['max_model_len']} tokens) is {c['full_context_gib']:.2f} GiB: {c['full_context_in_flight']} "
                  f"at once" for c in rep.kv_capacity]
    lines += ["", "START"] + [f"  {m['name']}: {m['run']}" for m in rep.machines]
    if rep.firewall:
        lines += ["", "FIREWALL (inbound TCP, Linux machines; Macs: the application firewall, docs/deploy.md)"]
        lines += rep.firewall
    lines += [f"ERROR: {e}" for e in rep.errors] + [f"warning: {w}" for w in rep.warnings]
    lines.append("config OK" if not rep.errors else f"{len(rep.errors)} error(s)")
    return "\n".join(lines)


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def main(settings: Settings, config: Path, as_json: bool = False, docker: Path | None = None) -> int:
    rep = check(settings, config, docker)
    print(json.dumps(rep.to_json(), indent=2) if as_json else render(rep, settings))
    return 2 if rep.errors else 0
