"""Speculative decoding in the class prediction (`disagg bench grading --predict`), per lane: each site model's verify
cost from gain.py's fit to its published Mac decode rates, its acceptance and match rate from the replayed class's
answers of its call (JSON analysis, prose feedback), and every assumption with its source."""

from __future__ import annotations

from dataclasses import dataclass

from backends.decode.speculative.gain import SHAPES, StepFit, fit_published, forward_cost, verify_cost

MAX_K = 3  # MLX's fused decode attention holds while query rows x GQA (8 on both site models) <= 32: k <= 3
DEPTHS = (0, 6000, 12000, 18000, 25000, 32768)


@dataclass(frozen=True)
class Acceptance:
    """A drafting source replayed on one call's answers: the share of steps that find a draft (match), drafted and
    kept tokens per verify step, alpha (kept / (kept + refusals): for the record, the speedup uses the counts), and
    drafting's own seconds per step (on this machine's CPU: a Mac's is faster)."""

    source: str
    match: float
    drafted: float
    kept: float
    alpha: float
    draft_s: float

    def speedup(self, shape, context: int, fit: StepFit, step_s: float) -> float:
        """Decode speedup: tokens per step over a step's cost, verify forwards at the mean draft length."""
        lo = min(MAX_K, int(self.drafted))
        frac = self.drafted - lo
        verify = (1 - frac) * forward_cost(shape, context, lo + 1, fit=fit) + frac * forward_cost(
            shape, context, min(MAX_K, lo + 1) + 1, fit=fit)
        tokens = self.match * (1 + self.kept) + (1 - self.match)
        cost = self.match * verify + (1 - self.match) + self.draft_s / step_s
        return max(1.0, tokens / cost)  # the controller turns drafting off where it does not pay


# bench/bench_class_drafts.py (its class of 20 submissions: prompts 2.4-6.3k tokens, greedy
# SmolLM2-135M answers of up to 200 tokens, k = 3), 2026-11-28 on this 2-core AMD EPYC (avx512_bf16): suffix decoding
# over the prompt and the class's earlier answers of the same call. An assumption for the lab's 30B+ models: that
# their answers quote the same notebooks and repeat the same shapes as often as SmolLM2-135M's do.
CLASS_REPLAY = {
    "analysis": Acceptance("suffix decoding over the prompt and the class's answers", 0.95, 2.28, 1.56, 0.77, 5e-5),
    "feedback": Acceptance("suffix decoding over the prompt and the class's answers", 0.92, 2.36, 1.54, 0.76, 5e-5),
}
ROLES = ("analysis", "feedback")  # the app's calls in order: the first model analyses, the second gives feedback


def fits(published: dict) -> dict[str, StepFit]:
    return {family: fit_published(SHAPES[family], r["decode"]) for family, r in published.items()
            if family in SHAPES}


def speedup_points(family: str, role: str, published: dict) -> tuple[tuple[int, float], ...]:
    """Decode speedup by context depth for a generation of `role` alone in its model's batch, at k <= MAX_K."""
    fit = fits(published)[family]
    step = 1.0 / published[family]["decode"][0][1]
    return tuple((d, CLASS_REPLAY[role].speedup(SHAPES[family], d, fit, step)) for d in DEPTHS)


def assumptions(published: dict, families: dict[str, str], roles: dict[str, str]) -> list[str]:
    """Every figure the speculative prediction rests on, with where it comes from."""
    out = []
    for model, family in families.items():
        if family not in SHAPES:
            continue
        fit = fits(published)[family]
        acc = CLASS_REPLAY[roles.get(model, "analysis")]
        costs = ", ".join(f"{d // 1000}k {verify_cost(SHAPES[family], d, MAX_K, fit=fit):.2f}" for d in (6000, 25000))
        out.append(f"{model} ({family}, {roles.get(model)} lane): a forward = {1e3 * fit.overhead_s:.1f} ms overhead + "
                   f"bytes at {fit.bytes_per_s / 1e9:.0f} GB/s, fitted to its published M3 Ultra decode rates "
                   f"{published[family]['decode']} (docs/deploy.md section 9); verify_cost at k = {MAX_K}: {costs}")
        out.append(f"{model}: {acc.source}: a draft on {acc.match:.0%} of steps, {acc.drafted:.2f} drafted and "
                   f"{acc.kept:.2f} kept per verify step (alpha {acc.alpha:.2f}), {1e3 * acc.draft_s:.2f} ms drafting "
                   f"a step (bench/bench_class_drafts.py: SmolLM2-135M's {roles.get(model)} answers, this machine)")
    out += [f"k <= {MAX_K}: MLX's fused decode attention needs query rows x GQA factor (8) <= 32",
            "bytes: 4-bit weights with group scales, bf16 KV read once per forward, experts the union of the tokens' "
            "(independent routing, an upper bound): gain.py SHAPES from each model's config.json",
            "a generation speculates only while it is its model's only one on its Mac (docs/speculative.md)",
            "every answer runs to its num_predict (docs/deploy.md section 9)"]
    return out


def lanes(plain: list, spec: list, roles: dict[str, str]) -> dict[str, dict]:
    """Per model (a lane of the app's): when its last answer ends and its decode request-seconds, without and with
    speculation (outcomes of backends/grading/predict.simulate)."""
    out = {}
    for model, role in roles.items():
        row = {"role": role}
        for name, outcomes in (("split", plain), ("speculative", spec)):
            mine = [o for o in outcomes if o.model == model]
            row[name] = {"end_s": round(max((o.end for o in mine), default=0.0), 1),
                         "decode_s": round(sum(o.terms.get("decode", 0.0) for o in mine), 1)}
        row["gain"] = round(row["split"]["end_s"] / max(row["speculative"]["end_s"], 1e-9), 2)
        out[model] = row
    return out


def print_lanes(p: dict) -> None:
    print("  per lane (the app's two models side by side; the class takes as long as the slower):")
    for model, row in p["lanes"].items():
        a, b = row["split"], row["speculative"]
        print(f"    {model} ({row['role']}): {a['end_s'] / 60:.1f} min -> {b['end_s'] / 60:.1f} min with speculative "
              f"decoding ({row['gain']:.2f}x); decode request-s {a['decode_s']:.0f} -> {b['decode_s']:.0f}")
    print("  assumptions:")
    for line in p["assumptions"]:
        print(f"    - {line}")
