"""`disagg status`'s KV fidelity part: the gateway's verdict rows as they stand (its /health) or forced now with the
operator credential (`--recheck`: POST /fidelity, docs/security.md "Operator re-checks"), each with what the gateway
adds to it (Lifecycle); without a gateway, `--recheck` runs the canary against the nodes themselves."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import aiohttp

from kv_bridge.config.settings import Settings
from kv_bridge.config.source import ConfigError
from kv_bridge.fidelity import Verdict, run_canary

OPERATOR_KEY_ENV = "DISAGG_OPERATOR_KEY"  # an operator key (auth.operator_keys) where the node secret is not at hand


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


def operator_key(s: Settings, flag: str | None = None) -> ClientKey:
    """What `--recheck` shows the gateway's POST /fidelity: --operator-key, else $DISAGG_OPERATOR_KEY, else the node
    token derived from the config's node secret (auth.OperatorKeys accepts it), else nothing (an open gateway)."""
    if flag:
        return ClientKey(flag, "--operator-key")
    if os.environ.get(OPERATOR_KEY_ENV):
        return ClientKey(os.environ[OPERATOR_KEY_ENV], f"${OPERATOR_KEY_ENV}")
    try:
        token = s.auth.node_token()
    except ConfigError as e:
        return ClientKey(None, "none", f"no operator credential here ({e})")
    return ClientKey(token, "the node secret") if token else ClientKey(None, "none")


@dataclass
class Lifecycle:
    """What the gateway adds to a pair's verdict (gateway/cluster/fidelity.py): whether its routing uses the pair,
    whether the verdict is stale (the last try could not run, or a node is down) and how old, an override, a
    real-traffic demotion's hold and the pair's calibration."""

    usable: bool | None = None
    stale: bool = False
    age_s: float | None = None
    errors: int = 0
    last_error: str | None = None
    override: dict | None = None  # {"usable", "reason"}
    hold: dict | None = None  # a real-traffic demotion: {"count", "finding", "hold_s", "left_s", "until", ...}
    calibration: dict | None = None  # {"allowance", "date", "reason", "gain_band"}

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
        if self.hold is not None:
            h, nth = self.hold, "" if self.hold["count"] < 2 else f" ({self.hold['count']} in a row)"
            when = f"held until {h['until']} ({_ago(h['left_s'])})" if h["left_s"] > 0 else "hold over"
            out.append(f"demoted by real traffic{nth}, {when}: a long canary, --recheck or calibrate lifts it")
        if self.calibration is not None:
            c = self.calibration
            out.append(f"calibrated {c['date'][:10]}: allowance {c['allowance']:g}, "
                       f"{c.get('gain_band') or 'no gain band'}")
        return "; ".join(out)


def _ago(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}min" if seconds < 7200 else \
        f"{seconds / 3600:.1f}h"


def verdict_of(row: dict) -> Verdict:
    """A pair of the gateway's verdicts (/health or POST /fidelity); one it holds no verdict for (a node down, the
    canary off, a restarted node carrying KV provisionally) is an "error" verdict that says why."""
    if row["state"] in ("verified", "failed"):
        return Verdict.from_json(row)
    if row["state"] == "error":
        return Verdict.from_json({**row, "message": row.get("last_error") or row.get("message") or ""})
    why = {"pending": "a node is down", "unchecked": "the gateway's canary is off ([fidelity] enabled)",
           "checking": "being checked again" + (f": {row['reverify']}" if row.get("reverify") else ""),
           "provisional": row.get("summary") or "provisional"}
    return Verdict(row["model"], row["prefill"], row["decode"], "error", message=why.get(row["state"], row["state"]))


def rows_of(rows: list[dict]) -> list[Verdict]:
    out = []
    for row in rows:
        v = verdict_of(row)
        v.lifecycle = Lifecycle.from_row(row)
        out.append(v)
    return out


async def gateway_rows(http, s: Settings, gw: dict, op: ClientKey | None, seen: dict) -> list[dict] | None:
    """The gateway's verdict rows: forced now (`op`: the operator credential, POST /fidelity) or as they stand (its
    /health); None when no gateway answers or it refused. `seen` records "401" (a client key wanted) and
    "recheck" (why a forced re-check was refused: the rows then are the standing ones)."""
    try:
        if op is not None:
            async with http.post(f"{s.gateway.url()}/fidelity", headers=op.headers) as r:
                if r.status == 200:
                    return (await r.json())["pairs"]
                err = (await r.json(content_type=None) or {}).get("error") or {}
                wait = f" (Retry-After {r.headers['Retry-After']} s)" if "Retry-After" in r.headers else ""
                seen["recheck"] = f"status: --recheck refused by the gateway ({r.status}{wait}): " \
                                  f"{err.get('message', '')}; its standing verdicts are shown"
        async with http.get(f"{s.gateway.url()}/health", headers=gw) as r:
            if r.status == 401:
                seen["gateway"] = "401"
                return None
            return (await r.json()).get("fidelity", [])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, AttributeError):
        return None  # no gateway here


async def fidelity_verdicts(http, s: Settings, up: set[str], headers: dict, gw: dict, seen: dict,
                    op: ClientKey | None = None) -> list[Verdict]:
    """Every pair's canary verdict (each with the gateway's Lifecycle as `.lifecycle`): the gateway's standing ones,
    or with `op` (--recheck) run now through it; without a gateway, run here pair by pair with --recheck only."""
    rows = await gateway_rows(http, s, gw, op, seen)
    if rows is not None:
        return rows_of(rows)
    out = []
    for m in s.models:
        for p in m.prefill:
            for d in m.decode:
                if op is None:
                    out.append(Verdict(m.id, p, d, "error", message="not read: no gateway answers (`disagg status "
                                       "--recheck` runs the canary against the nodes)"))
                elif p in up and d in up:
                    out.append(await run_canary(http, m.id, (p, s.node(p).url), (d, s.node(d).url), headers,
                                                s.fidelity.timeout_s))
                else:
                    out.append(Verdict(m.id, p, d, "error", message="node down"))
    return out
