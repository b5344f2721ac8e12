"""`disagg status`: one table for a whole site (each node's health, fingerprint agreement, load, last error), the KV
link bandwidth of every prefill -> decode pair, measured with a test transfer (backends/probe.py), and the KV
fidelity of every (model, prefill, decode) pair: the canary run now (kv_bridge/fidelity.py), through the gateway when
it answers (so its routing learns the verdicts too), else straight against the nodes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import aiohttp

from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings
from kv_bridge.config.source import ConfigError
from kv_bridge.fidelity import Verdict, run_canary

API_KEY_ENV = "DISAGG_API_KEY"  # a client key for the gateway, on a machine that cannot read auth.api_keys_file


@dataclass
class ClientKey:
    """The key status sends the gateway and where it came from; `missing` says why there is none when the config
    wants one (the gateway then answers 401 and status goes to the nodes itself)."""

    key: str | None
    source: str
    missing: str | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}


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


@dataclass
class Lifecycle:
    """What the gateway adds to a pair's verdict (gateway/cluster/fidelity.py): whether its routing uses the pair,
    whether the verdict is stale (the last try could not run, or a node is down) and how old, and an override."""

    usable: bool | None = None
    stale: bool = False
    age_s: float | None = None
    errors: int = 0
    last_error: str | None = None
    override: dict | None = None  # {"usable", "reason"}

    @classmethod
    def from_row(cls, row: dict) -> "Lifecycle":
        return cls(**{k: row[k] for k in cls.__dataclass_fields__ if k in row})

    def note(self) -> str:
        """The NOTE column's lifecycle part: stale since when and why, and an override's reason."""
        out = []
        if self.stale:
            age = "" if self.age_s is None else f" ({_ago(self.age_s)} old)"
            out.append(f"stale{age}: {self.last_error or 'a node is down'}")
        if self.override is not None:
            out.append(f"override ({'used' if self.override['usable'] else 'not used'}): {self.override['reason']}")
        return "; ".join(out)


def _ago(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}min" if seconds < 7200 else \
        f"{seconds / 3600:.1f}h"


def _verdict(row: dict) -> Verdict:
    """A pair of the gateway's POST /fidelity answer; one it could not check (a node down, the canary off) is an
    "error" verdict that says why."""
    if row["state"] in ("verified", "failed"):
        return Verdict.from_json(row)
    if row["state"] == "error":
        return Verdict.from_json({**row, "message": row.get("last_error") or row.get("message") or ""})
    why = {"pending": "a node is down", "unchecked": "the gateway's canary is off ([fidelity] enabled)",
           "checking": "being checked again" + (f": {row['reverify']}" if row.get("reverify") else "")}
    return Verdict(row["model"], row["prefill"], row["decode"], "error", message=why.get(row["state"], row["state"]))


async def _fidelity(http, s: Settings, up: set[str], headers: dict, gw: dict, seen: dict) -> list[Verdict]:
    """Every pair's canary verdict: from the gateway's POST /fidelity when it answers (each with its Lifecycle as
    `.lifecycle`), else run here, pair by pair. `seen["gateway"]` records "401" when the gateway wanted a key it did
    not get."""
    try:
        async with http.post(f"{s.gateway.url()}/fidelity", headers=gw) as r:
            if r.status == 200:
                out = []
                for row in (await r.json())["pairs"]:
                    v = _verdict(row)
                    v.lifecycle = Lifecycle.from_row(row)
                    out.append(v)
                return out
            if r.status == 401:
                seen["gateway"] = "401"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
        pass  # no gateway here: ask the nodes themselves
    out = []
    for m in s.models:
        for p in m.prefill:
            for d in m.decode:
                if p in up and d in up:
                    out.append(await run_canary(http, m.id, (p, s.node(p).url), (d, s.node(d).url), headers,
                                                s.fidelity.timeout_s))
                else:
                    out.append(Verdict(m.id, p, d, "error", message="node down"))
    return out


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
                  key: ClientKey | None = None) -> dict:
    """Every node's status, fingerprint consensus, (when probe_bytes > 0) every up pair's KV link and (`fidelity`)
    every pair's KV fidelity. `key`: the gateway's client key (default: client_key(s))."""
    key = client_key(s) if key is None else key
    gw, seen = key.headers, {}
    token = s.auth.node_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    total = max(timeout, s.fidelity.timeout_s if fidelity else 0) + 60
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
        verdicts = await _fidelity(http, s, up, headers, gw, seen) if fidelity else []
        queue = await _queue(http, s, gw, seen)
    return {"nodes": nodes, "links": links, "consensus": consensus, "fidelity": verdicts, "queue": queue,
            "key": key_line(key, seen.get("gateway"))}


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
            note = "; ".join(n for n in (v.message, life.note()) if n) or "-"
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
         fidelity: bool = True, api_key: str | None = None) -> int:
    """Exit 0 when every node is up, agrees, every link probe passed and every pair's KV is verified (or vouched for
    by a [[fidelity.override]]); 1 otherwise."""
    result = asyncio.run(collect(settings, probe_bytes, timeout, fidelity, client_key(settings, api_key)))
    print(json.dumps(to_json(result), indent=2) if as_json else render(result, color=sys.stdout.isatty()))
    if result["key"]:
        print(result["key"], file=sys.stderr)
    healthy = all(n.up and n.agreement == "ok" for n in result["nodes"]) and all(l.ok for l in result["links"]) \
        and all(passes(v) for v in result["fidelity"])
    return 0 if healthy else 1
