"""`disagg status`: one table for a whole site (each node's health, fingerprint agreement, load, last error), the KV
link bandwidth of every prefill -> decode pair, measured with a test transfer (backends/probe.py), and the KV
fidelity of every (model, prefill, decode) pair: the gateway's verdicts as they stand (its /health; nothing is run),
or with `--recheck` the canary run now (kv_bridge/fidelity.py) through the gateway's operator-only POST /fidelity (so
its routing learns the verdicts too), else straight against the nodes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import aiohttp

from backends.cli.status_fidelity import (OPERATOR_KEY_ENV, ClientKey, Lifecycle, fidelity_verdicts, operator_key,
                                          verdict_of)
from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings
from kv_bridge.config.source import ConfigError
from kv_bridge.fidelity import Verdict

__all__ = ["OPERATOR_KEY_ENV", "ClientKey", "Lifecycle", "operator_key", "verdict_of", "collect", "main", "render"]

API_KEY_ENV = "DISAGG_API_KEY"  # a client key for the gateway, on a machine that cannot read auth.api_keys_file


def client_key(s: Settings, flag: str | None = None) -> ClientKey:
    """--api-key, else $DISAGG_API_KEY, else the config's first key (auth.api_keys, auth.api_keys_file) where this
    machine can read it."""
    if flag:
        return ClientKey(flag, "--api-key")
    if os.environ.get(API_KEY_ENV):
        return ClientKey(os.environ[API_KEY_ENV], f"${API_KEY_ENV}")
    try:
        keys = s.auth.client_keys()
    except ConfigError as e:
        return ClientKey(None, "none", f"no API key here ({e})")
    return ClientKey(keys[0], "the config") if keys else ClientKey(None, "none (the gateway runs open)")


def key_line(key: ClientKey, gateway: str | None) -> str | None:
    """One line for the operator when the gateway's part of the table is missing for want of a key."""
    fix = f"pass --api-key KEY or set {API_KEY_ENV} (a client key, one line of the gateway box's api-keys file)"
    if gateway == "401" and key.key:
        return f"status: the gateway refused the API key from {key.source} (401): {fix}; fidelity was run against " \
               f"the nodes directly and the queue is not shown"
    if gateway == "401" or (key.missing and gateway is None):
        why = key.missing or "no API key given and the gateway wants one (401)"
        return f"status: {why}: {fix}; fidelity was run against the nodes directly and the queue is not shown"
    return None


@dataclass
class NodeStatus:
    name: str
    role: str
    url: str
    models: list[str]
    up: bool = False
    fingerprint: dict = field(default_factory=dict)
    quantization: dict = field(default_factory=dict)
    agreement: str = "-"  # ok | MISMATCH | - (down, or nothing to compare with)
    batch_size: int | None = None
    transfers: int | None = None
    cache_bytes: int | None = None
    error: str | None = None


@dataclass
class LinkStatus:
    model: str
    prefill: str
    decode: str
    ok: bool = False
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    @property
    def gbit_s(self) -> float:
        return 8 * self.bytes / self.seconds / 1e9 if self.ok and self.seconds > 0 else 0.0


async def _health(http: aiohttp.ClientSession, s: Settings, node: NodeConfig, headers: dict) -> NodeStatus:
    pool = "prefill" if node.role == "prefill" else "decode"
    st = NodeStatus(node.name, node.role, node.url, [m.id for m in s.models if node.name in getattr(m, pool)])
    try:
        async with http.get(node.url + "/health", headers=headers) as r:
            body = await r.json(content_type=None)
            if r.status != 200:
                st.error = f"HTTP {r.status}: {(body.get('error') or {}).get('message') or body}"
                return st
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        st.error = f"unreachable: {type(e).__name__} {e}".strip()
        return st
    st.up = True
    st.fingerprint, st.quantization = body.get("fingerprint") or {}, body.get("quantization") or {}
    st.batch_size, st.transfers, st.cache_bytes = body.get("batch_size"), body.get("transfers"), body.get("cache_bytes")
    return st


def agree(nodes: list[NodeStatus]) -> dict[str, str | None]:
    """Per model: the fingerprint most up nodes report (prefill nodes break ties); each node's `agreement` is set."""
    consensus: dict[str, str | None] = {}  # votes: a prefill node counts 1.5 so a 1-1 split sides with it
    models = {m for n in nodes for m in n.models}
    for mid in sorted(models):
        votes: dict[str, int] = {}
        for n in nodes:
            fp = n.fingerprint.get(mid) if n.up else None
            if fp:
                votes[fp] = votes.get(fp, 0) + (1.5 if n.role == "prefill" else 1.0)
        consensus[mid] = max(votes, key=votes.get) if votes else None
    for n in nodes:
        if not n.up:
            continue
        bad = [m for m in n.models if n.fingerprint.get(m) != consensus.get(m)]
        n.agreement = "MISMATCH " + ",".join(bad) if bad else "ok"
    return consensus


async def _probe(http, s: Settings, mid: str, p: NodeConfig, d: NodeConfig, nbytes: int, headers: dict,
                 timeout: float) -> LinkStatus:
    link = LinkStatus(mid, p.name, d.name)
    try:
        async with http.post(d.url + "/v1/probe/expect", json={"model": mid, "bytes": nbytes}, headers=headers) as r:
            exp = await r.json(content_type=None)
            if r.status != 200:
                raise RuntimeError(f"{d.name}: {(exp.get('error') or {}).get('message')}")
        wait = asyncio.ensure_future(_result(http, d, exp["transfer_id"], headers, timeout))
        body = {"model": mid, "transfer_id": exp["transfer_id"], "tokens": exp["tokens"], "kv_target": exp["kv_target"]}
        async with http.post(p.url + "/v1/probe/send", json=body, headers=headers) as r:
            sent = await r.json(content_type=None)
            if r.status != 200:
                wait.cancel()
                raise RuntimeError(f"{p.name}: {(sent.get('error') or {}).get('message')}")
        got = await wait
        link.ok, link.bytes, link.seconds, link.error = got["ok"], got.get("bytes", 0), got.get("seconds", 0.0), \
            got.get("error")
    except Exception as e:  # a probe that fails is a finding to show, not a crash of the whole status
        link.error = str(e) or type(e).__name__
    return link


async def _result(http, d: NodeConfig, tid: str, headers: dict, timeout: float) -> dict:
    async with http.get(f"{d.url}/v1/probe/{tid}", params={"timeout": str(timeout)}, headers=headers) as r:
        return await r.json()


async def _queue(http, s: Settings, gw: dict, seen: dict) -> dict | None:
    """The gateway's request queue from its /health (gateway/cluster/queue.py); None when no gateway answers."""
    try:
        async with http.get(f"{s.gateway.url()}/health", headers=gw) as r:
            if r.status == 401:
                seen["gateway"] = "401"
                return None
            return (await r.json()).get("queue")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
        return None


async def collect(s: Settings, probe_bytes: int = 64 << 20, timeout: float = 10.0, fidelity: bool = True,
                  key: ClientKey | None = None, recheck: ClientKey | None = None) -> dict:
    """Every node's status, fingerprint consensus, (when probe_bytes > 0) every up pair's KV link and (`fidelity`)
    every pair's KV fidelity. `key`: the gateway's client key (default: client_key(s)); `recheck`: the operator
    credential (operator_key(s)) to run every pair's canary now, else the verdicts are read."""
    key = client_key(s) if key is None else key
    gw, seen = key.headers, {}
    token = s.auth.node_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    total = max(timeout, s.fidelity.timeout_s if fidelity and recheck else 0) + 60
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=total, connect=timeout)) as http:
        nodes = await asyncio.gather(*(_health(http, s, n, headers) for n in s.nodes))
        consensus = agree(nodes)
        up = {n.name for n in nodes if n.up}
        links = []
        if probe_bytes > 0:
            for m in s.models:  # one pair at a time: concurrent probes would share (and halve) a link
                for p in m.prefill:
                    for d in m.decode:
                        if p in up and d in up:
                            links.append(await _probe(http, s, m.id, s.node(p), s.node(d), probe_bytes, headers,
                                                      timeout))
                        else:
                            links.append(LinkStatus(m.id, p, d, error="node down"))
        verdicts = await fidelity_verdicts(http, s, up, headers, gw, seen, recheck) if fidelity else []
        queue = await _queue(http, s, gw, seen)
    return {"nodes": nodes, "links": links, "consensus": consensus, "fidelity": verdicts, "queue": queue,
            "key": "\n".join(x for x in (key_line(key, seen.get("gateway")), seen.get("recheck")) if x) or None}


def await_fidelity(health_url: str, headers: dict, timeout_s: float, nodes: set[str]) -> list[str]:
    """Blocking (`disagg up`): until the gateway's canary has a verdict for every pair of two of `nodes` (the roles
    this machine runs; at most `timeout_s`, 0: not at all), one line per pair: what the operator should know before
    the first request."""
    import time
    import urllib.request

    deadline, rows = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(health_url, headers=headers), timeout=5) as r:
                rows = [r for r in json.loads(r.read()).get("fidelity", []) if {r["prefill"], r["decode"]} <= nodes]
        except (OSError, ValueError, KeyError):
            rows = []
        if all(r["state"] not in ("pending", "checking") for r in rows):
            break
        time.sleep(0.5)
    return [f"KV fidelity {r['model']} {r['prefill']} -> {r['decode']}: {r.get('summary') or r['state']}"
            for r in rows]


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def render(result: dict, color: bool = False) -> str:
    red = (lambda t: f"\033[1;31m{t}\033[0m") if color else (lambda t: t)
    rows = [("NODE", "ROLE", "HEALTH", "MODELS", "FINGERPRINT", "AGREE", "QUANT", "BATCH", "KV IN FLIGHT",
             "CACHE MiB", "LAST ERROR")]
    for n in result["nodes"]:
        fps = ",".join(sorted(set(n.fingerprint.values()))) or "-"
        quant = ",".join(sorted(set(n.quantization.values()))) or "-"
        rows.append((n.name, n.role, "up" if n.up else "DOWN", ",".join(n.models), fps, n.agreement, quant,
                     "-" if n.batch_size is None else str(n.batch_size),
                     "-" if n.transfers is None else str(n.transfers), _mib(n.cache_bytes), (n.error or "-")[:80]))
    lines = _table(rows, flag=lambda r: r[2] == "DOWN" or r[5].startswith("MISMATCH"), mark=red)
    if result["links"]:
        rows = [("MODEL", "PREFILL -> DECODE", "MiB", "SECONDS", "Gbit/s", "ERROR")]
        for l in result["links"]:
            rows.append((l.model, f"{l.prefill} -> {l.decode}", _mib(l.bytes) if l.ok else "-",
                         f"{l.seconds:.3f}" if l.ok else "-", f"{l.gbit_s:.2f}" if l.ok else "FAILED",
                         (l.error or "-")[:100]))
        lines += [""] + _table(rows, flag=lambda r: r[4] == "FAILED", mark=red)
    if result.get("fidelity"):
        rows = [("MODEL", "PREFILL -> DECODE", "KV FIDELITY", "WORST", "REL. ERROR", "TOLERANCE", "GREEDY", "KL",
                 "NOTE")]
        for v in result["fidelity"]:
            figs, life = v.state != "error" and v.error is not None, _lifecycle(v)  # real traffic: no figure
            state = v.state.upper() if v.state == "failed" else v.state
            state += " (over allowance)" if v.over_allowance else ""  # flagged: its WARN names the calibrate command
            parts = (life.note(), v.message) if life.hold else (v.message, life.note())  # why first, when held
            note = "; ".join(n for n in parts if n) or "-"
            rows.append((v.model, f"{v.prefill} -> {v.decode}", state + (" (stale)" if life.stale else ""),
                         f"{v.tensor} layer {v.layer}" if figs else "-", f"{v.error:.2g}" if figs else "-",
                         f"{v.tolerance:g}" if figs else "-", v.greedy or "-",
                         "-" if v.kl is None else f"{v.kl:.2g}", note[:160]))
        lines += [""] + _table(rows, flag=lambda r: r[2] != "verified", mark=red)
    if result.get("queue") is not None:
        q = result["queue"]
        rows = [("MODEL", "WAITING", "MAX QUEUED", "OLDEST WAIT s", "QUEUED SO FAR", "MEAN WAIT s", "LONGEST WAIT s")]
        for model in sorted(q["models"].keys() | q.get("waits", {}).keys()):
            now, past = q["models"].get(model, {}), q.get("waits", {}).get(model, {})
            rows.append((model, str(now.get("queued", 0)), str(now.get("max_queued", "-")),
                         f"{now['oldest_wait_s']:.1f}" if now else "-", str(past.get("count", 0)),
                         f"{past['mean_s']:.1f}" if past else "-", f"{past['max_s']:.1f}" if past else "-"))
        lines += ["", f"   gateway queue (max wait {q['max_wait_s']:g} s)" + ("" if len(rows) > 1 else ": empty")]
        if len(rows) > 1:
            lines += _table(rows, flag=lambda r: False, mark=red)
    return "\n".join(lines)


def _table(rows: list[tuple], flag, mark) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for i, r in enumerate(rows):
        line = "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
        out.append(mark("!! " + line) if i and flag(r) else "   " + line)
    return out


def _lifecycle(v: Verdict) -> Lifecycle:
    """The gateway's Lifecycle of a verdict; an empty one for a canary run here."""
    return getattr(v, "lifecycle", None) or Lifecycle()


def passes(v: Verdict) -> bool:
    """Whether a pair counts as healthy for the exit status: verified (stale too: its verdict stands), or vouched for
    by an override."""
    ov = _lifecycle(v).override
    return v.ok if ov is None else bool(ov["usable"])


def to_json(result: dict) -> dict:
    return {"nodes": [asdict(n) for n in result["nodes"]], "consensus": result["consensus"],
            "links": [{**asdict(l), "gbit_s": l.gbit_s} for l in result["links"]],
            "fidelity": [{**v.to_json(), **asdict(_lifecycle(v))} for v in result.get("fidelity", [])],
            "queue": result.get("queue"), "api_key": result.get("key")}


def main(settings: Settings, as_json: bool = False, probe_bytes: int = 64 << 20, timeout: float = 10.0,
         fidelity: bool = True, api_key: str | None = None, recheck: bool = False,
         operator: str | None = None) -> int:
    """Exit 0 when every node is up, agrees, every link probe passed and every pair's KV is verified (or vouched for
    by a [[fidelity.override]]); 1 otherwise. `recheck`: run every pair's canary now (the operator credential:
    `operator`, else $DISAGG_OPERATOR_KEY, else the node token)."""
    op = operator_key(settings, operator) if recheck else None
    result = asyncio.run(collect(settings, probe_bytes, timeout, fidelity, client_key(settings, api_key), op))
    print(json.dumps(to_json(result), indent=2) if as_json else render(result, color=sys.stdout.isatty()))
    if result["key"]:
        print(result["key"], file=sys.stderr)
    healthy = all(n.up and n.agreement == "ok" for n in result["nodes"]) and all(l.ok for l in result["links"]) \
        and all(passes(v) for v in result["fidelity"])
    return 0 if healthy else 1
