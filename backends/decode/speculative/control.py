"""A decode node's speculative-decoding controller and counters, one per model: per-token acceptance kept per drafting
source and match-length bucket, and per step the proposal and draft length of best expected gain at the verify cost
the node measures (verify_cost.py). Pure Python (no MLX): the MLX thread writes, /metrics reads plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from backends.decode.speculative.sources import BUCKET_NAMES, BUCKETS, bucket
from backends.decode.speculative.verify_cost import VerifyCost
from kv_bridge.config.speculative import SpeculativeConfig

# A prior per bucket (alpha, in pseudo-trials): short matches start doubtful, long ones trusted, so a few spurious
# 2-token matches do not speak for 20-token quotes. The prior never decays; observations do.
PRIOR_ALPHA = (0.35, 0.55, 0.75, 0.85)
PRIOR_WEIGHT = 2.0
COSTLY, COSTLY_SECONDS = 0.02, 5e-4  # a drafted token's cost (in plain steps, or seconds) past which it is a model's
assert len(PRIOR_ALPHA) == len(BUCKETS)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens one verify step yields with k drafted tokens, each accepted with probability `rate` until the first
    rejection (Leviathan et al. 2023, eq. 1): 1 + r + ... + r^k (the target always adds one)."""
    return sum(rate ** i for i in range(k + 1))


def speedup(rate: float, k: int, verify_cost: float, draft_cost: float = 0.0) -> float:
    """Decode speedup over plain steps: tokens per step over the step's cost in plain-step units."""
    return expected_tokens(rate, k) / (1.0 + k * (verify_cost + draft_cost))


def outcome(drafts: list[int], emitted: list[int]) -> tuple[int, int]:
    """(accepted, rejected) of one proposal against what the target emitted: its leading tokens emitted as proposed,
    and whether it emitted a different token in a proposed one's place (1) or not (0: all kept, or the step ended
    first: censored)."""
    a = 0
    while a < len(drafts) and a < len(emitted) and emitted[a] == drafts[a]:
        a += 1
    return a, int(a < len(drafts) and a < len(emitted))


class Proposal(NamedTuple):
    """One source's draft for the next tokens: its name, tokens, the match length it came from, its per-token cost."""

    name: str
    tokens: list[int]
    match_len: int = 0
    draft_cost: float = 0.0


@dataclass
class SpecStats:
    """Counters since start (MLX thread writes; /metrics reads). `requests[reason]`: generations by how they ran."""

    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # verify steps that ended on a refused draft (the rest kept all, or finished first)
    verify_steps: int = 0  # target forwards over y + at least one drafted token
    plain_steps: int = 0  # forwards of the speculative path with nothing drafted
    probes: int = 0  # verify steps run while off, to measure acceptance and cost again
    requests: dict[str, int] = field(default_factory=dict)
    by_source: dict[str, list[int]] = field(default_factory=dict)  # name -> [verify steps, drafted, accepted]
    draft_kv_tokens: int = 0  # prompt tokens whose drafter KV came from the prefill node (installed, not computed)

    def ran(self, reason: str) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + 1


class SpecController:
    """Per model. `choose(proposals, depth, limit)` picks the proposal and k to verify (None: a plain step);
    `observe` scores every proposal against what the target emitted (verified or not: a free source's unused draft
    still says whether it would have been kept), `verified` / `plain` count steps.

    alpha per (source, bucket) = (prior + accepted) / (prior weight + accepted + rejections), the observed counts
    discounted by (1 - ewma_alpha) per observation of that arm. A proposal's gain at k is expected_tokens(alpha, k) /
    (ratio(k) + k * draft_cost), ratio the measured verify step over a plain one (the config's verify_cost until
    measured). It verifies when the best gain exceeds 1 + min_gain (the arm verified last: 1 + min_gain - hysteresis).
    Off, every probe_every plain steps one step with a proposal verifies the smallest k that could pay (a probe), the
    proposal of the least observed arm."""

    def __init__(self, cfg: SpeculativeConfig, meter: VerifyCost | None = None) -> None:
        self.cfg = cfg
        self.stats = SpecStats()
        self.meter = meter or VerifyCost(cfg.verify_cost, cfg.cost_samples)
        self.arms: dict[tuple[str, int], list[float]] = {}  # (source, bucket) -> [accepted, rejections], discounted
        self.k = 0  # the draft length of the last step (0: plain): /metrics
        self._last: tuple[str, int] | None = None  # the arm verified last (hysteresis)
        self._since_probe = cfg.probe_every
        self.trace: list[tuple] | None = None  # when a list: per step (source or "", drafted, kept): bench/
        self.draft_seconds: dict[str, float] = {}  # per source: seconds per drafted token, a running mean

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.sources)

    def alpha(self, name: str, match_len: int) -> float:
        b = bucket(match_len)
        acc, rej = self.arms.get((name, b), (0.0, 0.0))
        return (PRIOR_ALPHA[b] * PRIOR_WEIGHT + acc) / (PRIOR_WEIGHT + acc + rej)

    def seen(self, p: Proposal) -> float:
        """How much its arm has observed (discounted accepted + rejections): a probe goes to the least seen. Free
        sources are scored every step; a costly one (a model) only when it drafted, so without this its arm would
        stay at the prior while a lookup with a longer match always won the probe."""
        return sum(self.arms.get((p.name, bucket(p.match_len)), (0.0, 0.0)))

    @property
    def rate(self) -> float:
        """Every arm's observations pooled (with one weak prior): the acceptance /metrics shows."""
        acc = sum(a for a, _ in self.arms.values())
        rej = sum(r for _, r in self.arms.values())
        return (1.0 + acc) / (2.0 + acc + rej)

    def arm_report(self) -> list[tuple[str, str, float]]:
        """(source, bucket name, alpha) of every arm observed: /metrics."""
        return [(name, BUCKET_NAMES[b], self.alpha(name, BUCKETS[b][0])) for name, b in sorted(self.arms)]

    def new_generation(self) -> None:
        """A generation starts on the speculative path: while off, its first step with a proposal probes."""
        self._since_probe = self.cfg.probe_every

    def gain(self, p: Proposal, k: int, depth: int) -> float:
        return expected_tokens(self.alpha(p.name, p.match_len), k) / (self.meter.ratio(k, depth) + k * p.draft_cost)

    def best(self, p: Proposal, depth: int, limit: int) -> tuple[int, float]:
        """(k, gain) of the best draft length for proposal p (k <= its length and limit)."""
        ks = range(1, min(len(p.tokens), limit) + 1)
        return max(((k, self.gain(p, k, depth)) for k in ks), key=lambda kg: kg[1], default=(0, 0.0))

    def _pays(self, p: Proposal, g: float) -> bool:
        h = self.cfg.hysteresis if (p.name, bucket(p.match_len)) == self._last else 0.0
        return g > 1.0 + self.cfg.min_gain - h

    def ask(self, name: str, match_len: int, depth: int, limit: int, draft_cost: float) -> int:
        """How many tokens to ask a costly source for (0: none): its best k where that would pay at its last match
        length, the probe length when a probe is due, every one when not adaptive."""
        if not self.cfg.adaptive:
            return limit
        k, g = self.best(Proposal(name, [0] * limit, match_len, draft_cost), depth, limit)
        if k and self._pays(Proposal(name, [], match_len), g):
            return k
        return self.probe_len(depth, draft_cost) if self._since_probe >= self.cfg.probe_every else 0

    def timed_draft(self, name: str, seconds: float, tokens: int) -> None:
        per = seconds / max(1, tokens)
        was = self.draft_seconds.get(name)
        self.draft_seconds[name] = per if was is None else 0.8 * was + 0.2 * per

    def draft_cost(self, name: str, prior: float, depth: int) -> float:
        """A drafted token's cost in plain steps: measured (its draft time over a plain step's) once both are, else
        the source's own figure (the config's draft_cost for a draft model)."""
        per, plain = self.draft_seconds.get(name), self.meter.plain_seconds(depth)
        return per / plain if per is not None and plain else prior

    def costly(self, name: str, cost: float) -> bool:
        """A source that runs a model: drafted only when its proposal would be verified. Free ones (a lookup: tens
        of microseconds) draft every step. Unmeasured, a source is free unless it says it has a cost."""
        per = self.draft_seconds.get(name)
        return cost > COSTLY or (per is not None and per > COSTLY_SECONDS)

    def probe_len(self, depth: int, draft_cost: float = 0.0) -> int:
        """The smallest k that would pay at alpha = 1: what a probe drafts. Where none would, 1 while the cost is
        only the prior (a probe measures it), else 0 (never probe)."""
        for k in range(1, self.cfg.num_draft + 1):
            if (k + 1) / (self.meter.ratio(k, depth) + k * draft_cost) > 1.0 + self.cfg.min_gain:
                return k
        return 1 if self.meter.measured(1, depth) is None else 0

    def choose(self, proposals: list[Proposal], depth: int, limit: int) -> tuple[int, int] | None:
        """(index into proposals, k) to verify now, or None for a plain step. `limit`: the most drafted tokens this
        step may carry (num_draft, the fused-attention cap, the tokens left)."""
        props = [(i, p) for i, p in enumerate(proposals) if p.tokens]
        limit = min(limit, self.cfg.num_draft)
        if not props or limit < 1:
            return None
        if not self.cfg.adaptive:
            i, p = props[0]
            return self._chose(i, p, min(len(p.tokens), limit))
        scored = [(i, p, *self.best(p, depth, limit)) for i, p in props]
        i, p, k, g = max(scored, key=lambda s: s[3])
        if self._pays(p, g):
            return self._chose(i, p, k)
        self._last = None
        if self._since_probe >= self.cfg.probe_every:  # the least known arm: a costly source is scored only when
            i, p = min(props, key=lambda ip: (self.seen(ip[1]), -self.alpha(ip[1].name, ip[1].match_len)))
            k = min(self.probe_len(depth, p.draft_cost), len(p.tokens), limit)
            if k:
                self.stats.probes += 1
                return self._chose(i, p, k)
        return None

    def would_verify(self, proposals: list[Proposal], depth: int, limit: int) -> bool:
        """Whether choose() would verify one of these (no state changes): the plain pipeline stops chaining for it."""
        limit = min(limit, self.cfg.num_draft)
        props = [p for p in proposals if p.tokens]
        if not props or limit < 1:
            return False
        if not self.cfg.adaptive:
            return True
        if self._since_probe >= self.cfg.probe_every and self.probe_len(depth) > 0:
            return True
        return any(self._pays(p, self.best(p, depth, limit)[1]) for p in props)

    def _chose(self, i: int, p: Proposal, k: int) -> tuple[int, int]:
        self.k, self._last, self._since_probe = k, (p.name, bucket(p.match_len)), 0
        return i, k

    def observe(self, p: Proposal, emitted: list[int], k: int | None = None) -> tuple[int, int]:
        """Score proposal p (its first k tokens when verified at k) against what the target emitted; its arm learns
        from it. Returns (accepted, rejected)."""
        a, r = outcome(p.tokens if k is None else p.tokens[:k], emitted)
        if a or r:
            keep = 1.0 - self.cfg.ewma_alpha
            arm = self.arms.setdefault((p.name, bucket(p.match_len)), [0.0, 0.0])
            arm[0], arm[1] = keep * arm[0] + a, keep * arm[1] + r
        return a, r

    def share(self, n: int) -> bool:
        """Whether n generations of this model should each speculate on their own (one after another) rather than
        share a plain batch step, on wall times only: the speculative path's measured tokens per second (its recent
        decode steps: drafting, verify, trim, all of it) against n tokens per measured batch step of n (timed while
        the batch ran alone). Either unmeasured: the batch (which then times itself). Never a modelled speedup: at a
        prior verify_cost it can promise what the hardware does not give."""
        if n <= 1:
            return True
        enough = self.cfg.cost_samples
        batch, path = self.meter.batch_seconds(n), self.meter.path_rate()
        if not (batch and batch[1] >= enough and path and path[1] >= enough):
            return False
        return path[0] > n / batch[0] * (1.0 + self.cfg.min_gain)

    def verified(self, name: str, drafted: int, accepted: int, rejected: int) -> None:
        s = self.stats
        s.verify_steps += 1
        s.drafted += drafted
        s.accepted += accepted
        s.rejected += rejected
        src = s.by_source.setdefault(name, [0, 0, 0])
        src[0], src[1], src[2] = src[0] + 1, src[1] + drafted, src[2] + accepted
        if self.trace is not None:
            self.trace.append((name, drafted, accepted))

    def plain(self) -> None:
        self.stats.plain_steps += 1
        self._since_probe += 1
        self.k = 0
        if self.trace is not None:
            self.trace.append(("", 0, 0))
