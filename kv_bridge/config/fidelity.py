"""`[fidelity]`'s schedule, `[[fidelity.override]]` and the calibration file: when the gateway runs the KV canary
again (a failed pair's backoff, a real-traffic demotion's hold, the periodic re-check, an operator's at most every
`recheck_min_s`), when repeated errors alert, a pair an operator vouches for (or rules out) with a stated reason, and
a pair's own measured error allowance and gain band. kv_bridge/fidelity.py's FidelityConfig (the canary itself)
builds on this."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field, field_validator


class FidelityOverride(BaseModel):
    """One `[[fidelity.override]]`: the pairs it names take (`usable = true`) or never take (`false`) the model's
    disaggregated path whatever the canary says; the canary still runs and is shown beside it."""

    model: str | None = Field(default=None, description="a model id; unset: every model")
    prefill: str | None = Field(default=None, description="a prefill node's name; unset: every prefill node")
    decode: str | None = Field(default=None, description="a decode node's name; unset: every decode node")
    usable: bool = Field(default=True, description="true: the pair carries KV even if its canary failed; false: "
                         "never, even if verified")
    reason: str = Field(description="why (shown in /health, `disagg status` and the gateway's log)")

    @field_validator("reason")
    @classmethod
    def _stated(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("an override needs its reason: say why this pair is trusted (or ruled out)")
        return v.strip()

    def matches(self, model: str, prefill: str, decode: str) -> bool:
        return all(want is None or want == got for want, got in ((self.model, model), (self.prefill, prefill),
                                                                 (self.decode, decode)))


class FidelitySchedule(BaseModel):
    """The canary's lifecycle settings (gateway/cluster/fidelity.py)."""

    failed_retry_s: float = Field(default=300.0, gt=0, description="a failed pair's canary runs again after this, "
                                  "then after twice as long each time it fails again (up to retry_max_s)")
    retry_max_s: float = Field(default=900.0, gt=0, description="the longest wait between two tries of one pair, "
                               "failed or not checked (retry_s doubles up to this too)")
    recheck_s: float = Field(default=3600.0, ge=0, description="a verified pair's canary runs again after this "
                             "(its verdict stands meanwhile); 0: only on a node change or on demand")
    alert_after_errors: int = Field(default=3, ge=1, description="canaries in a row that could not run before the "
                                    "gateway logs an ERROR (disagg_kv_fidelity_errors counts them for alerting)")
    recheck_min_s: float = Field(default=60.0, ge=0, description="an operator's POST /fidelity (or `disagg status "
                                 "--recheck`) runs a pair's canary at most this often; within it: 429 with "
                                 "Retry-After")
    traffic_hold_s: float = Field(default=600.0, gt=0, description="a pair a real request's KV failed the decode "
                                  "node's layer-0 check on (traffic_check) stays demoted at least this long, then until "
                                  "a canary of the long form (start_canary_tokens) verifies it; twice as long each "
                                  "time real traffic demotes it again, up to traffic_hold_max_s; an operator's "
                                  "`disagg status --recheck` or `disagg fidelity calibrate` lifts it sooner")
    traffic_hold_max_s: float = Field(default=7200.0, gt=0, description="the longest real-traffic hold; a pair "
                                      "this long past its hold without another failure starts again at "
                                      "traffic_hold_s")
    calibration_file: Path = Field(default=Path(".disagg/fidelity-calibration.json"), description="where `disagg fidelity "
                                   "calibrate` writes each pair's own allowance and the gateway reads it; relative "
                                   "to the config file's folder")
    override: list[FidelityOverride] = Field(default_factory=list, description="[[fidelity.override]]: pairs an "
                                             "operator vouches for or rules out, each with its reason")

    def calibration_path(self) -> Path:
        from kv_bridge.config.source import config_path

        p = self.calibration_file.expanduser()
        return p if p.is_absolute() else config_path().resolve().parent / p

    def override_for(self, model: str, prefill: str, decode: str) -> FidelityOverride | None:
        """The first override naming this pair, or None."""
        return next((o for o in self.override if o.matches(model, prefill, decode)), None)


class FidelityCalibration(BaseModel):
    """One pair's own error allowance and per-head gain band, measured by `disagg fidelity calibrate` (backends/cli/fidelity.py) on the
    nodes as they were: it applies only while both nodes' KV identities (their /health kv_identity digests) are the
    ones it was measured on, so an upgrade or a new KV setting on either side sends the pair back to its class's."""

    model: str
    prefill: str
    decode: str
    allowance: float = Field(gt=0, description="the rel. RMS allowance past the wire's own, per head")
    weights: str = Field(description="the allowance class the pair has without it (full, 8, 4)")
    prefill_kv: str = Field(description="the prefill node's KV identity digest it was measured on")
    decode_kv: str = Field(description="the decode node's KV identity digest it was measured on")
    date: str = Field(description="when it was measured (UTC, ISO 8601)")
    reason: str = Field(description="how: the canaries run and the worst excess they read")
    canaries: int = Field(default=0, ge=0)
    excess_max: float = Field(default=0.0, ge=0, description="the worst canary's rel. RMS past the wire's own")
    gain_band: list[dict[str, list[list[float]]]] | None = Field(
        default=None, description="per layer {\"k\", \"v\"}: [lo per KV head, hi per KV head], the heads' honest gains "
        "over the canaries widened (kv_bridge/fidelity.py gain_band); the canary judges each head's gain by it, "
        "within the class's bounds. None: the class's bounds alone (a calibration from before the band)")

    def applies(self, prefill_kv: str | None, decode_kv: str | None) -> bool:
        return (self.prefill_kv, self.decode_kv) == (prefill_kv, decode_kv)


def read_calibrations(path: Path) -> list[FidelityCalibration]:
    """`path`'s calibrations ([] when it does not exist); ValueError naming the file for a malformed one."""
    if not path.exists():
        return []
    try:
        return [FidelityCalibration(**row) for row in json.loads(path.read_text())["calibrations"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a fidelity calibration file ({e}); delete it and run `disagg fidelity "
                         f"calibrate` again") from None


def write_calibration(path: Path, entry: FidelityCalibration) -> None:
    """Add `entry` to `path`, replacing the same pair's (written whole, then renamed: a gateway never reads half)."""
    rows = [c for c in read_calibrations(path) if (c.model, c.prefill, c.decode) !=
            (entry.model, entry.prefill, entry.decode)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"calibrations": [c.model_dump() for c in [*rows, entry]]}, indent=1) + "\n")
    tmp.replace(path)
