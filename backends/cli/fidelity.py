"""`disagg fidelity calibrate --model M [-n 20] --config F`: a pair's own KV error allowance, measured through the real
pair (the nodes' canary routes, as `disagg status --recheck` without a gateway runs them): `n` varied canaries, each
reporting how much rel. RMS past the wire's own it needed and each KV head's gain; the worst excess with a margin and
the heads' gain band are written to [fidelity] calibration_file with its date and reason, tied to both nodes' KV
identities (the gateway uses them while they hold)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime, timezone

import aiohttp

from kv_bridge.config.fidelity import FidelityCalibration, write_calibration
from kv_bridge.config.settings import Settings
from kv_bridge.config.source import ConfigError
from kv_bridge.fidelity import Verdict, allowance_class, band_summary, gain_band, run_canary

MARGIN, FLOOR = 1.25, 0.02  # over the worst canary's excess (a new text reads a little differently); the least


def add_parser(sub, common) -> None:
    f = sub.add_parser("fidelity", help="the KV fidelity canary's per-pair tools").add_subparsers(dest="action",
                                                                                                required=True)
    c = f.add_parser("calibrate", parents=[common], help="measure each pair's own error allowance and per-head gain "
                     "band from varied canaries and write them to [fidelity] calibration_file")
    c.add_argument("--model", required=True, help="the model id (its pairs: every prefill x decode node)")
    c.add_argument("-n", "--canaries", type=int, default=20, help="canaries per pair (default 20)")
    c.add_argument("--prefill", help="only this prefill node")
    c.add_argument("--decode", help="only this decode node")
    c.add_argument("--reason", default="", help="added to the recorded reason (who ran it, why)")
    c.set_defaults(func=_cmd_calibrate)


def allowance_of(excesses: list[float]) -> float:
    """The calibrated allowance: the worst honest canary's excess with MARGIN, never below FLOOR."""
    if not excesses:
        raise ValueError("no canary measured: nothing to calibrate from")
    return round(max(FLOOR, MARGIN * max(excesses)), 4)


def structural(v: Verdict) -> str | None:
    """Why a canary says the KV itself is wrong (a finding that is not the error's magnitude), or None."""
    if v.state == "verified":
        return None
    bad = [f for f in v.findings if f.get("metric") not in ("rel. RMS", "rel. RMS past the wire")]
    if v.state == "failed" and (bad or not v.findings):
        return v.summary()
    return None if v.state == "failed" else f"could not run: {v.message}"


async def _identity(http, url: str, model: str, headers: dict) -> dict:
    async with http.get(url + "/health", headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{url} answered /health with HTTP {r.status}")
        ident = ((await r.json()).get("kv_identity") or {}).get(model)
    if not isinstance(ident, dict) or not ident.get("digest"):
        raise RuntimeError(f"{url} reports no KV identity for {model}: upgrade that node (calibrations are tied to it)")
    return ident


async def calibrate_pair(http, s: Settings, model: str, p: str, d: str, n: int, headers: dict,
                         say=print) -> FidelityCalibration:
    """`n` canaries through (p, d); the pair's FidelityCalibration. RuntimeError naming the canary when one finds a
    wrong KV (placement, position, gain), could not run, or when a node changed meanwhile."""
    purl, durl = s.node(p).url, s.node(d).url
    before = [await _identity(http, u, model, headers) for u in (purl, durl)]
    cls = allowance_class(before[0].get("weights"), before[1].get("weights"))
    excesses, layers = [], []
    for i in range(n):
        v = await run_canary(http, model, (p, purl), (d, durl), headers, s.fidelity.timeout_s,
                             {"calibrate": True, "variant": i, "prefill_weights": before[0].get("weights")})
        why = structural(v)
        if why is not None:
            raise RuntimeError(f"canary {i + 1} of {model} on {p} -> {d}: {why}; not calibrated (a calibration "
                               f"measures an honest pair: mend the fault first)")
        if v.excess is None:
            raise RuntimeError(f"{d} does not report the canary's excess: upgrade it")
        excesses.append(v.excess)
        layers.append(v.layers)
        say(f"  {p} -> {d} canary {i + 1}/{n}: {v.state}{' (over allowance)' if v.over_allowance else ''}, "
            f"needs {v.excess:.3g} past the wire's own ({v.seconds:.1f}s)")
    after = [await _identity(http, u, model, headers) for u in (purl, durl)]
    if [x["digest"] for x in after] != [x["digest"] for x in before]:
        raise RuntimeError(f"{p} or {d} changed its KV identity during the calibration; run it again")
    try:
        band = gain_band(layers)
    except ValueError as e:
        raise RuntimeError(f"{p} -> {d}: {e}") from None
    return FidelityCalibration(
        model=model, prefill=p, decode=d, allowance=allowance_of(excesses), weights=cls,
        prefill_kv=before[0]["digest"], decode_kv=before[1]["digest"],
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"), canaries=n, excess_max=max(excesses),
        gain_band=band,
        reason=f"{n} varied canaries, worst {max(excesses):.3g} past the wire's own, x{MARGIN}; weights "
               f"{before[0].get('quantization')} -> {before[1].get('quantization')} (class {cls})")


async def calibrate(s: Settings, model: str, n: int, prefill: str | None = None, decode: str | None = None,
                    reason: str = "", say=print) -> list[FidelityCalibration]:
    """Every pair of `model` (or the one named), written to the calibration file; raises on the first that fails."""
    route = s.route(model)
    pairs = [(p, d) for p in route.prefill for d in route.decode
             if prefill in (None, p) and decode in (None, d)]
    if not pairs:
        raise ConfigError(f"model {route.id} has no pair {prefill or '*'} -> {decode or '*'}; its prefill nodes: "
                          f"{route.prefill}, decode nodes: {route.decode}")
    token = s.auth.node_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    out, path = [], s.fidelity.calibration_path()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10)) as http:
        for p, d in pairs:
            cal = await calibrate_pair(http, s, route.id, p, d, n, headers, say)
            if reason:
                cal.reason += f"; {reason}"
            write_calibration(path, cal)
            say(f"{route.id} {p} -> {d}: allowance {cal.allowance:g} (class {cal.weights}: its own rel. RMS "
                f"allowance past the wire's) and {band_summary(cal.gain_band)} written to {path}")
            out.append(cal)
    return out


def _cmd_calibrate(settings: Settings, args: argparse.Namespace) -> int:
    if args.canaries < 1:
        raise ConfigError("-n must be at least 1 (20 gives a stable allowance)")
    try:
        asyncio.run(calibrate(settings, args.model, args.canaries, args.prefill, args.decode, args.reason))
    except (RuntimeError, aiohttp.ClientError) as e:
        print(f"disagg fidelity calibrate: {e}", file=sys.stderr)
        return 1
    return 0
