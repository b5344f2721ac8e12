"""Which (model, prefill node, decode node) pairs carry the right KV: the fidelity canary (kv_bridge/fidelity.py) and
its verdict's lifecycle. A verdict moves only on evidence (a completed comparison); a canary that could not run (a
busy node's 429, a timeout, a node unreachable) leaves it standing, marked stale. It runs when a pair's nodes are up
and no verdict applies to them (first, or one of them restarted or changed what shapes its KV: its /health's boot_id
and kv_identity), again after a failure (backoff), every `recheck_s` and on demand (POST /fidelity). While
`[fidelity] required`, only a pair verified on the nodes as they are now (or vouched for by `[[fidelity.override]]`)
takes the model's disaggregated path; a verified pair whose node restarted with the same KV identity (same digest)
carries KV provisionally until its re-check says otherwise. A pair's calibrated allowance and gain band (`disagg
fidelity calibrate`) ride on its canaries while both identities are the ones it was measured on. A pair real traffic
demoted (a request's KV failed the decode node's layer-0 check) is held (gateway/cluster/fidelity_state.py). Seen in
/health, the disagg_kv_fidelity* gauges and the WARN/ERROR lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from kv_bridge.config.settings import Settings
from kv_bridge.fidelity import Verdict, run_canary

from gateway.cluster.fidelity_state import Calibrations, TrafficHold, ago, describe_changes
from gateway.cluster.nodes import NodePool
from gateway.metrics import Metrics

log = logging.getLogger("gateway.cluster.fidelity")
Pair = tuple[str, str, str]  # (model, prefill node, decode node)
Identity = tuple  # ((prefill boot, its KV digest), (decode boot, its KV digest)) for the pair's model
GAUGE = {"verified": 1, "provisional": 0.5, "failed": 0, "pending": -1, "checking": -1, "unchecked": -1, "error": -2}


@dataclass
class _PairState:
    verdict: Verdict | None = None  # the last completed comparison (verified | failed)
    at: float = 0.0  # monotonic: when it completed
    identity: Identity | None = None  # the nodes it was measured on; it applies only while they are the same
    error: Verdict | None = None  # the last canary that could not run, since the last completed one
    errors: int = 0  # canaries in a row that could not run
    failures: int = 0  # failed verdicts in a row (their backoff)
    retry_at: float = 0.0  # monotonic: no try before this (after an error or a failure)
    task: asyncio.Task | None = None
    fields: dict | None = None  # node -> its kv_identity fields when the verdict was measured (to say what changed)
    seen: Identity | None = None  # the nodes as the last tick saw them (to log a change once)
    seen_fields: dict | None = None
    forced: float | None = None  # monotonic: when an operator last forced its canary (POST /fidelity)
    hold: TrafficHold = field(default_factory=TrafficHold)  # a real-traffic demotion (fidelity_state.py)


def _backoff(base: float, n: int, cap: float) -> float:
    return min(cap, base * 2 ** max(0, n - 1))


class Fidelity:
    """The canary's state per pair and the loop that runs it; `usable` is what routing asks."""

    def __init__(self, settings: Settings, pool: NodePool, metrics: Metrics) -> None:
        self.cfg, self.pool, self.metrics = settings.fidelity, pool, metrics
        self.pairs: dict[Pair, _PairState] = {
            (m.id, p, d): _PairState() for m in settings.models for p in m.prefill for d in m.decode}
        for pair in self.pairs:
            metrics.fidelity.labels(*pair).set(-1)
            metrics.fidelity_errors.labels(*pair).set(0)
            ov = self.cfg.override_for(*pair)
            if ov is not None:
                log.warning("KV fidelity of %s on %s -> %s overridden ([[fidelity.override]]): %s whatever the "
                            "canary says, because: %s", *pair, "always used" if ov.usable else "never used",
                            ov.reason)
        metrics.refreshers.append(self._refresh)
        self.calibrations = Calibrations(self.cfg)

    # ---- what routing and operators read ----

    def _identity(self, pair: Pair) -> Identity:
        model, p, d = pair
        return tuple(self.pool.nodes[n].identity(model) for n in (p, d))

    def _fields(self, pair: Pair) -> dict:
        return {n: dict(self.pool.nodes[n].kv_identity.get(pair[0]) or {}) for n in pair[1:]}

    def _current(self, pair: Pair) -> Verdict | None:
        """The pair's verdict if it was measured on the nodes as they are now."""
        st = self.pairs[pair]
        return st.verdict if st.verdict is not None and st.identity == self._identity(pair) else None

    def usable(self, model: str, prefill: str, decode: str) -> bool:
        """May this pair carry the model's KV now? An override says; else, canary off: always; a failed pair never;
        a verified one (stale or not); an unverified one only while the canary is not `required`."""
        pair = (model, prefill, decode)
        st = self.pairs.get(pair)
        if st is None:
            return True
        ov = self.cfg.override_for(*pair)
        if ov is not None:
            return ov.usable
        if not self.cfg.enabled:
            return True
        v = self._current(pair)
        if v is not None:
            return v.ok
        return self._provisional(pair) or not self.cfg.required

    def _provisional(self, pair: Pair) -> bool:
        """Verified on these nodes' KV identities, and only a process changed since (a restart: the same digests on
        both sides): the pair carries KV until its re-check, which demotes it if it fails."""
        st = self.pairs[pair]
        if st.verdict is None or not st.verdict.ok or st.identity is None or not self._both_up(pair):
            return False
        digests = [kv for _, kv in self._identity(pair)]
        return None not in digests and digests == [kv for _, kv in st.identity]

    def state(self, pair: Pair) -> str:
        """unchecked (canary off) | verified | failed (a verdict that applies) | provisional (verified before a
        restart that kept the KV identity, re-check pending) | checking | error (the last try could not run) |
        pending (no verdict applies yet)."""
        st = self.pairs[pair]
        if not self.cfg.enabled:
            return "unchecked"
        v = self._current(pair)
        if v is not None:
            return v.state
        if self._provisional(pair):
            return "provisional"
        if st.task is not None:
            return "checking"
        return "error" if st.error is not None else "pending"

    def _both_up(self, pair: Pair) -> bool:
        nodes = self.pool.nodes
        return all(n in nodes and nodes[n].up for n in pair[1:])

    def _next_check(self, pair: Pair, now: float) -> float | None:
        st, v = self.pairs[pair], self._current(pair)
        if st.retry_at > now:
            return st.retry_at - now
        if v is not None and v.ok and self.cfg.recheck_s > 0:
            return max(0.0, st.at + self.cfg.recheck_s - now)
        return None if v is not None and v.ok else 0.0

    def snapshot(self) -> list[dict]:
        """For /health: every pair, its state, figure and lifecycle (stale, age, errors, next check, override)."""
        now, out = time.monotonic(), []
        for pair, st in self.pairs.items():
            v, ov = self._current(pair), self.cfg.override_for(*pair)
            row = {"model": pair[0], "prefill": pair[1], "decode": pair[2], "state": self.state(pair),
                   "usable": self.usable(*pair), "checking": st.task is not None, "errors": st.errors,
                   "last_error": None if st.error is None else st.error.message,
                   "age_s": None if v is None else round(now - st.at, 1),
                   "stale": v is not None and (st.error is not None or not self._both_up(pair)),
                   "override": None if ov is None else {"usable": ov.usable, "reason": ov.reason},
                   "calibration": Calibrations.row(self._calibration(pair)), "hold": st.hold.row(now),
                   "demoted_by": self._demoted_by(pair)}
            nxt = self._next_check(pair, now)
            row["next_check_s"] = None if nxt is None or not self.cfg.enabled else round(nxt, 1)
            if st.verdict is not None and v is None:
                row["reverify"] = self._changes(st.identity, self._identity(pair), pair, st.fields)
            if v is not None:
                row.update({k: x for k, x in v.to_json().items() if k not in ("layers", "state")})
                row["summary"] = v.summary() + self._stale_note(pair, row) + (
                    f"; {st.hold.note(now)}" if st.hold.active else "")
            elif st.error is not None:
                row["summary"] = st.error.summary()
            if row["state"] == "provisional":
                row["summary"] = (f"provisional: {row['reverify']}; carries KV on its verdict of "
                                  f"{ago(now - st.at)} ago ({st.verdict.summary()}) until its re-check")
            out.append(row)
        return out

    def _stale_note(self, pair: Pair, row: dict) -> str:
        if not row["stale"]:
            return ""
        why = (self.pairs[pair].error.message if self.pairs[pair].error is not None
               else "a node is down")
        return f" [stale: measured {ago(row['age_s'])} ago; since then {why}]"

    def _refresh(self, metrics: Metrics) -> None:
        """Just before a scrape: the gauges from the live state (a node's restart moves them without an event)."""
        now = time.monotonic()
        for pair, st in self.pairs.items():
            metrics.fidelity.labels(*pair).set(GAUGE[self.state(pair)])
            metrics.fidelity_errors.labels(*pair).set(st.errors)
            metrics.fidelity_usable.labels(*pair).set(1 if self.usable(*pair) else 0)
            metrics.fidelity_age.labels(*pair).set(-1 if self._current(pair) is None else now - st.at)
            metrics.fidelity_hold.labels(*pair).set(st.hold.left(now))
            by = self._demoted_by(pair)
            for why in ("traffic", "canary"):
                metrics.fidelity_demoted.labels(*pair, why).set(1 if by == why else 0)

    def _demoted_by(self, pair: Pair) -> str | None:
        """Why a pair carries no KV on its verdict: "traffic" (held after real traffic failed it), "canary" (a
        failed canary), or None."""
        if self.pairs[pair].hold.active:
            return "traffic"
        v = self._current(pair)
        return "canary" if v is not None and not v.ok else None

    # ---- calibration (`disagg fidelity calibrate`) and what the canary is told ----

    def _calibration(self, pair: Pair):
        """The pair's calibration, if it was measured on both nodes' KV identities as they are now."""
        return self.calibrations.get(pair, self._digests(pair))

    def _digests(self, pair: Pair) -> list:
        return [kv for _, kv in self._identity(pair)]

    def _expect(self, pair: Pair) -> dict:
        """What the decode node's /v1/fidelity/expect is told: the prefill side's weights (the allowance class is
        the pair's), the pair's calibrated allowance and gain band."""
        weights = (self.pool.nodes[pair[1]].kv_identity.get(pair[0]) or {}).get("weights")
        cal = self._calibration(pair)
        return {k: x for k, x in (("prefill_weights", weights), ("allowance", cal and cal.allowance),
                                  ("gain_band", cal and cal.gain_band),
                                  ("long", True if self.pairs[pair].hold.active else None)) if x is not None}

    # ---- running the canary ----

    def _changes(self, was: Identity | None, now: Identity, pair: Pair, fields: dict | None = None) -> str:
        return describe_changes(was, now, pair, {n: self.pool.nodes[n].kv_identity for n in pair[1:]}, fields)

    def _due(self, pair: Pair, now: float) -> bool:
        st = self.pairs[pair]
        ident = self._identity(pair)
        if st.seen is not None and ident != st.seen and st.verdict is not None:
            then = ("its KV identity is the same: it carries KV provisionally while it is checked again"
                    if self._provisional(pair) else "checked again before it carries KV")
            log.warning("KV fidelity of %s on %s -> %s: %s; %s", *pair,
                        self._changes(st.seen, ident, pair, st.seen_fields), then)
            st.retry_at, st.failures = 0.0, 0  # a new node is not behind the old one's backoff
        st.seen, st.seen_fields = ident, self._fields(pair)
        self._hold_lifted(pair, now)
        if st.task is not None or not self._both_up(pair) or now < max(st.retry_at, st.hold.until):
            return False
        v = self._current(pair)
        if v is None or not v.ok:
            return True  # never verified here, or failed and its backoff is over
        return self.cfg.recheck_s > 0 and now - st.at >= self.cfg.recheck_s

    def _hold_lifted(self, pair: Pair, now: float) -> None:
        """A real-traffic hold ends without a long canary when either node's KV identity changed (an upgrade, a
        fix) or an operator calibrated the pair after the demotion."""
        hold = self.pairs[pair].hold
        if hold.active and hold.lifted(pair, tuple(self._digests(pair)), self._calibration(pair)):
            self.pairs[pair].retry_at = 0.0

    def _start(self, session: aiohttp.ClientSession, pair: Pair, forced: bool = False) -> asyncio.Task:
        st = self.pairs[pair]
        st.task = asyncio.create_task(self._check(session, pair, forced), name=f"fidelity-{'-'.join(pair)}")
        return st.task

    def tick(self, session: aiohttp.ClientSession) -> None:
        """Start the canary of every pair that is due: both nodes up, not in a backoff, and no verdict that applies
        to them now, or a failed one, or a verified one older than `recheck_s`."""
        if not self.cfg.enabled:
            return
        now = time.monotonic()
        for pair in self.pairs:
            if self._due(pair, now):
                self._start(session, pair)

    async def _check(self, session: aiohttp.ClientSession, pair: Pair, forced: bool = False) -> Verdict:
        model, p, d = pair
        nodes, started, fields = self.pool.nodes, self._identity(pair), self._fields(pair)
        try:
            v = await run_canary(session, model, (p, nodes[p].url), (d, nodes[d].url), {}, self.cfg.timeout_s,
                                 self._expect(pair))
        finally:
            self.pairs[pair].task = None
        self._record(pair, v, started, fields, forced)
        return v

    def _record(self, pair: Pair, v: Verdict, started: Identity, fields: dict | None = None,
                forced: bool = False) -> None:
        """Only a completed comparison on the nodes as they still are moves the verdict; an error is counted. A
        pair real traffic demoted is re-promoted only by a canary of the long form or one an operator forced."""
        st, now = self.pairs[pair], time.monotonic()
        if v.state == "error":
            st.error, st.errors = v, st.errors + 1
            st.retry_at = now + _backoff(self.cfg.retry_s, st.errors, self.cfg.retry_max_s)
            self._log_error(pair, v)
            return
        if started != self._identity(pair):  # a node changed under the canary: its figure is the old node's
            log.info("KV fidelity of %s on %s -> %s: a node changed while the canary ran (%s); it runs again",
                     *pair, self._changes(started, self._identity(pair), pair, fields))
            return
        if v.ok and st.hold.active and not st.hold.verified(pair, v.long, forced, now):
            st.retry_at = now + max(self.cfg.traffic_hold_s, st.hold.left(now))  # short canaries: not each tick
            return
        was, provisional = self._current(pair), self._provisional(pair)
        st.verdict, st.at, st.identity, st.fields, st.error, st.errors = v, now, started, fields, None, 0
        self.metrics.fidelity_error.labels(*pair).set(v.error if v.error is not None else -1)
        if v.ok:
            st.failures, st.retry_at = 0, 0.0
            again = " again (it had failed)" if was is not None and not was.ok else ""
            level = logging.WARNING if v.over_allowance else logging.INFO
            log.log(level, "KV fidelity of %s on %s -> %s verified%s: %s, %.1fs", *pair, again,
                    v.summary().removeprefix("verified: "), v.seconds)
            return
        st.failures += 1
        wait = _backoff(self.cfg.failed_retry_s, st.failures, self.cfg.retry_max_s)
        st.retry_at = now + wait
        level = logging.WARNING if was is None or was.ok else logging.INFO  # once per fall, not per retry
        cause = v.summary().removeprefix("failed: ").removeprefix("worst ")
        log.log(level, "KV fidelity of %s on %s -> %s FAILED%s: %s (wire %s, KV %s); %s; checked again in %s",
                *pair, " (demoted: it carried KV provisionally after a restart)" if provisional else "", cause,
                v.wire_dtype, v.kv_dtype, self._consequence(pair), ago(wait))

    def demote(self, model: str, prefill: str, decode: str, finding: str) -> None:
        """A real request's KV failed the decode node's layer-0 check (its done line's kv_check): the pair is failed
        now and held (fidelity_state.py): no canary for `traffic_hold_s` (doubling with each such demotion), then
        only one of the long form re-promotes it (the short canary cannot reach a fault only long prompts hit)."""
        pair = (model, prefill, decode)
        if pair not in self.pairs:
            return
        st, now = self.pairs[pair], time.monotonic()
        hold = st.hold.demote(self.cfg, tuple(self._digests(pair)), finding, now)
        if hold is None:  # a request in flight before the demotion: its finding is shown, the hold stands
            log.info("KV fidelity of %s on %s -> %s: another request's KV failed the layer-0 check: %s", *pair, finding)
            return
        st.verdict = Verdict(model, prefill, decode, "failed", metric="real-traffic position error",
                             message=f"a request's KV failed the decode node's layer-0 check: {finding}")
        st.at, st.identity, st.fields, st.error, st.errors = now, self._identity(pair), self._fields(pair), None, 0
        st.retry_at = st.hold.until
        self.metrics.fidelity_error.labels(*pair).set(-1)
        log.warning("KV fidelity of %s on %s -> %s FAILED on real traffic: %s; %s; %s", *pair, finding,
                    self._consequence(pair), st.hold.note(now))

    def _consequence(self, pair: Pair) -> str:
        ov = self.cfg.override_for(*pair)
        if ov is not None:
            return (f"{'still used' if ov.usable else 'not used'} by [[fidelity.override]]: {ov.reason}")
        v = self._current(pair)
        if v is not None:
            return "its requests go on disaggregated" if v.ok else f"this pair's requests prefill on {pair[2]} instead"
        if self._provisional(pair):
            return "its requests go on disaggregated provisionally (a restart kept its KV identity)"
        if not self.cfg.required:
            return "its requests take the disaggregated path unverified ([fidelity] required = false)"
        return f"its requests prefill on {pair[2]} until it is verified"

    def _log_error(self, pair: Pair, v: Verdict) -> None:
        st = self.pairs[pair]
        cur = self._current(pair)
        keeps = "" if cur is None else f"it keeps its verdict ({cur.state}, measured {ago(time.monotonic() - st.at)}" \
                                       f" ago, now stale); "
        alert = st.errors >= self.cfg.alert_after_errors
        log.log(logging.ERROR if alert else logging.WARNING,
                "KV fidelity of %s on %s -> %s could not be checked (%d in a row%s): %s; %s%s; tried again in %s",
                *pair, st.errors, f", alert after {self.cfg.alert_after_errors}" if alert else "", v.message, keeps,
                self._consequence(pair), ago(st.retry_at - time.monotonic()))

    def recheck_wait(self, model: str | None = None) -> float:
        """Seconds until an operator may force the canary of every up pair (of `model`) again: `recheck_min_s` after
        the last forced one (a borderline pair is not re-judged at will); 0: now. A canary running counts as now."""
        now, waits = time.monotonic(), [0.0]
        for pair, st in self.pairs.items():
            if (model is None or pair[0] == model) and self._both_up(pair) and st.task is None \
                    and st.forced is not None:
                waits.append(st.forced + self.cfg.recheck_min_s - now)
        return max(waits)

    async def check_now(self, session: aiohttp.ClientSession, model: str | None = None) -> list[dict]:
        """On demand (an operator's; callers check recheck_wait first): the canary of every pair (of `model`) whose
        nodes are up, one after another (pairs share links and MLX threads); waits for the verdicts. A canary that
        cannot run (a busy node) changes no verdict."""
        for pair, st in self.pairs.items():
            if (model is None or pair[0] == model) and self._both_up(pair):
                if st.task is None:
                    st.forced = time.monotonic()
                task = st.task or self._start(session, pair, forced=True)  # one running answers for this pair
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(task)
        return [row for row in self.snapshot() if model is None or row["model"] == model]

    async def run(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        """Forever: a tick every `interval_s` (the health poll's); the app cancels this on shutdown."""
        try:
            while True:
                try:
                    self.tick(session)
                except Exception:  # a bug here must not stop the checks silently
                    log.exception("fidelity tick failed")
                await asyncio.sleep(interval_s)
        finally:
            for st in self.pairs.values():
                if st.task is not None:
                    st.task.cancel()
