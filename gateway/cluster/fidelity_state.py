"""What the gateway keeps per fidelity pair beside its verdict (gateway/cluster/fidelity.py): what changed in its
nodes, its calibration (`disagg fidelity calibrate`'s file, re-read when it changes) and a real-traffic demotion's
hold. A pair
whose request KV failed the decode node's layer-0 check stays demoted: the usual short canary cannot reach a fault
only long prompts hit, so only a canary of the long form (`start_canary_tokens`) after a hold re-promotes it (the
hold doubling with each such demotion), or an operator: a forced re-check, a calibration measured after it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from kv_bridge.config.fidelity import FidelityCalibration, FidelitySchedule, read_calibrations
from kv_bridge.fidelity import band_summary

log = logging.getLogger("gateway.cluster.fidelity")


@dataclass
class TrafficHold:
    """A pair's real-traffic demotion: `active` from the demotion until a long canary or an operator lifts it."""

    active: bool = False
    count: int = 0  # demotions by real traffic in a row (the hold doubles with each; reset after a clean spell)
    until: float = 0.0  # monotonic: no canary before this
    seconds: float = 0.0  # the hold's length (traffic_hold_s, doubled with each demotion in a row)
    since: float = 0.0  # wall clock: when real traffic demoted it
    finding: str = ""  # what the decode node's check found
    digests: tuple | None = None  # both nodes' KV digests then: another identity (an upgrade, a fix) lifts it

    def demote(self, cfg: FidelitySchedule, digests: tuple, finding: str, now: float) -> float | None:
        """A request's KV failed the check: the hold's length, or None while the pair is demoted already (a request
        in flight before the demotion: it does not double the hold)."""
        self.finding = finding
        if self.active:
            return None
        if now - self.until > cfg.traffic_hold_max_s:  # clean for that long since its last hold: starts over
            self.count = 0
        self.count += 1
        hold = min(cfg.traffic_hold_max_s, cfg.traffic_hold_s * 2 ** (self.count - 1))
        self.active, self.until, self.seconds, self.since, self.digests = True, now + hold, hold, time.time(), digests
        return hold

    def verified(self, pair: tuple, long: bool, forced: bool, now: float) -> bool:
        """A canary verified the pair: whether that lifts the hold (one an operator forced, or one of the long form
        once the hold is over; the count stays then: real traffic failing it again doubles the hold)."""
        if forced or (long and now >= self.until):
            log.warning("KV fidelity of %s on %s -> %s: its real-traffic demotion is lifted by %s", *pair,
                        "an operator's re-check" if forced else "a canary of the long form")
            self.active, self.count = False, 0 if forced else self.count
            return True
        log.warning("KV fidelity of %s on %s -> %s: a canary verified it, but not in the long form (the decode node's "
                    "[fidelity] start_canary_tokens is 0 or within canary_tokens): it stays demoted by real traffic "
                    "(%s); `disagg status --recheck` lifts it", *pair, self.finding)
        return False

    def lifted(self, pair: tuple, digests: tuple, cal: FidelityCalibration | None) -> bool:
        """Lifted without a long canary: either node's KV identity changed (an upgrade, a fix) or an operator
        calibrated the pair after the demotion."""
        why = ("a node's KV identity changed" if None not in digests and digests != self.digests else
               "`disagg fidelity calibrate` measured it since" if measured_after(cal, self.since) else None)
        if why:
            self.lift()
            log.warning("KV fidelity of %s on %s -> %s: its real-traffic demotion is lifted (%s); checked again now",
                        *pair, why)
        return why is not None

    def lift(self) -> None:
        """An operator's word (a forced re-check that verified, a newer calibration) or another KV identity: the
        count starts over."""
        self.active, self.count, self.until = False, 0, 0.0

    def left(self, now: float) -> float:
        return max(0.0, self.until - now) if self.active else 0.0

    def row(self, now: float) -> dict | None:
        """/health's `hold`: why, since and until when, and what lifts it."""
        if not self.active:
            return None
        left = self.left(now)
        until = datetime.fromtimestamp(time.time() + left, timezone.utc).isoformat(timespec="seconds")
        return {"by": "real traffic", "count": self.count, "finding": self.finding, "hold_s": self.seconds,
                "left_s": round(left, 1),
                "until": until, "since": datetime.fromtimestamp(self.since, timezone.utc).isoformat(timespec="seconds"),
                "lifted_by": "a canary of the long form (start_canary_tokens) once the hold is over, an operator's "
                             "`disagg status --recheck`, a `disagg fidelity calibrate` run, or a new KV identity"}

    def note(self, now: float) -> str:
        """One line for the pair's summary."""
        nth = "" if self.count < 2 else f" ({self.count} times in a row: its hold doubled)"
        left = self.left(now)
        when = (f"held until {datetime.fromtimestamp(time.time() + left, timezone.utc):%H:%M:%S} UTC "
                f"({ago(left)} from now), then a long canary verifies it again" if left > 0 else
                "its hold is over: a long canary verifies it again")
        return f"demoted by real traffic{nth}; {when}, or `disagg status --recheck`"


def ago(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}min" if seconds < 7200 else \
        f"{seconds / 3600:.1f}h"


def describe_changes(was: tuple | None, now: tuple, pair: tuple, kv_identity: dict, fields: dict | None) -> str:
    """What differs between two identities ((boot id, KV digest) per node) of a pair's nodes, in words;
    `kv_identity`: each node's kv_identity now, `fields`: as they were then (each changed field is named)."""
    if was is None:
        return "not measured yet"
    out = []
    for name, (boot0, kv0), (boot1, kv1) in zip(pair[1:], was, now):
        new, old = kv_identity[name].get(pair[0]) or {}, (fields or {}).get(name) or {}
        diff = ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in sorted(old.keys() | new.keys())
                         if k != "digest" and old.get(k) != new.get(k))
        if kv0 != kv1 and not diff:
            diff = f"digest {kv0} -> {kv1}"
        what = f"; its KV configuration changed: {diff}" if diff else ""
        if boot0 != boot1:
            out.append(f"{name} came back up (it reports no boot id: taken as another process{what})"
                       if boot1.startswith("up#") else
                       f"{name} restarted (boot id {boot0[:8]} -> {boot1[:8]}{what})")
        elif diff:
            out.append(f"{name}'s KV configuration changed ({diff})")
    return "; ".join(out) or "unchanged"


class Calibrations:
    """The pairs' calibrations (`[fidelity] calibration_file`), re-read whenever the file changes (calibrate writes
    it while the gateway runs); a bad file is logged and ignored (the class's allowance applies)."""

    def __init__(self, cfg: FidelitySchedule) -> None:
        self.cfg = cfg
        self._rows: list[FidelityCalibration] = []
        self._seen: float | None = None  # the file's mtime when read

    def get(self, pair: tuple[str, str, str], digests: list) -> FidelityCalibration | None:
        """The pair's calibration if it was measured on both nodes' KV identities `digests` as they are now."""
        path = self.cfg.calibration_path()
        try:
            mtime = path.stat().st_mtime
        except OSError:
            mtime = None
        if mtime != self._seen:
            try:
                self._rows = read_calibrations(path)
            except ValueError as e:
                log.error("KV fidelity calibrations not used: %s", e)
                self._rows = []
            self._seen = mtime
        return next((c for c in self._rows if (c.model, c.prefill, c.decode) == pair and c.applies(*digests)), None)

    @staticmethod
    def row(c: FidelityCalibration | None) -> dict | None:
        """/health's `calibration` of a pair."""
        return None if c is None else {"allowance": c.allowance, "date": c.date, "reason": c.reason,
                                       "gain_band": band_summary(c.gain_band)}


def measured_after(cal: FidelityCalibration | None, wall: float) -> bool:
    """Whether `cal` was measured after wall-clock time `wall` (an operator's calibration after a demotion)."""
    if cal is None:
        return False
    try:
        return datetime.fromisoformat(cal.date.replace("Z", "+00:00")).timestamp() > wall
    except ValueError:
        return False
