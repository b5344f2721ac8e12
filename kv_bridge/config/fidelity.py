"""`[fidelity]`'s schedule and `[[fidelity.override]]`: when the gateway runs the KV canary again (a failed pair's
backoff, the periodic re-check), when repeated errors alert, and a pair an operator vouches for (or rules out) with a
stated reason. kv_bridge/fidelity.py's FidelityConfig (the canary itself) builds on this."""

from __future__ import annotations

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
    override: list[FidelityOverride] = Field(default_factory=list, description="[[fidelity.override]]: pairs an "
                                             "operator vouches for or rules out, each with its reason")

    def override_for(self, model: str, prefill: str, decode: str) -> FidelityOverride | None:
        """The first override naming this pair, or None."""
        return next((o for o in self.override if o.matches(model, prefill, decode)), None)
