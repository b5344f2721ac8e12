"""A decode node's speculative-decoding controller and counters, one per model: it estimates the per-token acceptance
alpha (accepted over accepted plus rejections), picks the draft length that pays most at the configured verify cost,
turns drafting off where none pays (with hysteresis) and probes at the smallest draft length that could pay.

Pure Python (no MLX): the MLX thread writes, /metrics reads plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_bridge.config.speculative import SpeculativeConfig

PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0  # a weak prior: alpha = 0.5 from two pseudo-trials


def expected_tokens(rate: float, k: int) -> float:
    """Tokens one verify step yields with k drafted tokens, each accepted with probability `rate` until the first
    rejection (Leviathan et al. 2023, eq. 1): 1 + r + ... + r^k (the target always adds one)."""
    return sum(rate ** i for i in range(k + 1))


def speedup(rate: float, k: int, verify_cost: float, draft_cost: float = 0.0) -> float:
    """Decode speedup over plain steps: tokens per step over the step's cost in plain-step units."""
    return expected_tokens(rate, k) / (1.0 + k * (verify_cost + draft_cost))


def best_k(rate: float, cfg: SpeculativeConfig) -> tuple[int, float]:
    """(k, speedup) of the draft length 1..num_draft with the best expected speedup at acceptance `rate`."""
    gains = {k: speedup(rate, k, cfg.verify_cost, cfg.draft_cost) for k in range(1, cfg.num_draft + 1)}
    k = max(gains, key=gains.get)
    return k, gains[k]


def best_draft(rate: float, cfg: SpeculativeConfig) -> int:
    """The draft length with the best expected speedup, 0 (off) when none beats plain decoding by cfg.min_gain."""
    k, gain = best_k(rate, cfg)
    return k if gain > 1.0 + cfg.min_gain else 0


def probe_len(cfg: SpeculativeConfig) -> int:
    """The smallest draft length that pays at all (at alpha = 1, where k tokens are all kept): what a probe drafts,
    so a probe costs least. 0: no k can ever pay at this verify cost (never probe)."""
    for k in range(1, cfg.num_draft + 1):
        if speedup(1.0, k, cfg.verify_cost, cfg.draft_cost) > 1.0 + cfg.min_gain:
            return k
    return 0


def outcome(drafts: list[int], emitted: list[int]) -> tuple[int, int]:
    """(accepted, rejected) of one verify step: drafted tokens the target emitted as drafted, and whether it emitted
    a different token in a drafted one's place (1) or not (0: every draft kept, or the step ended first: censored)."""
    a = 0
    while a < len(drafts) and a < len(emitted) and emitted[a] == drafts[a]:
        a += 1
    return a, int(a < len(drafts) and a < len(emitted))


@dataclass
class SpecStats:
    """Counters since start (MLX thread writes; /metrics reads). `requests[reason]`: generations by how they ran."""

    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # verify steps that ended on a refused draft (the rest kept all, or finished first)
    verify_steps: int = 0  # target forwards over y + at least one drafted token
    plain_steps: int = 0  # forwards of the speculative path with nothing drafted (off, or no n-gram match)
    requests: dict[str, int] = field(default_factory=dict)

    def ran(self, reason: str) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + 1


class SpecController:
    """Per model: the draft length for the next step (`draft_len`), updated from each step's outcome (`record`).

    alpha is the maximum-likelihood per-token acceptance of a geometric run: accepted / (accepted + rejections),
    both discounted by (1 - ewma_alpha) per verify step so it follows a generation that starts or stops quoting.
    The draft length is the k maximising `speedup(alpha, k, verify_cost)`. Hysteresis: drafting turns on when the
    best k's expected speedup exceeds 1 + min_gain, and off only when at alpha one standard error up it would fall
    below 1 + min_gain - hysteresis; k
    changes only for a gain of more than `hysteresis` / 4 over the current k. While off, every `probe_every` plain
    steps one step drafts `probe_len(cfg)` tokens (the smallest k that could pay) to measure again.
    """

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.stats = SpecStats()
        self._acc, self._rej = PRIOR_ACCEPTED, PRIOR_REJECTED
        self.probe = probe_len(cfg)
        self.k = cfg.num_draft if not cfg.adaptive else best_draft(self.rate, cfg)
        self._since_off = cfg.probe_every  # a node that starts off probes at once
        self.trace: list[int] | None = None  # when a list: each step's drafted count is appended (bench_spec)

    @property
    def enabled(self) -> bool:
        return self.cfg.method != "off"

    @property
    def rate(self) -> float:
        """The per-token acceptance estimate alpha."""
        return self._acc / (self._acc + self._rej)

    def _upper(self) -> float:
        """alpha one standard error up: drafting turns off only when even that would not pay, so a noisy run of
        rejections does not switch off a draft length that pays."""
        n = self._acc + self._rej
        return min(1.0, self.rate + (self.rate * (1.0 - self.rate) / n) ** 0.5)

    def new_generation(self) -> None:
        """A generation starts on the speculative path: while off, its first step probes (its text may quote)."""
        self._since_off = self.cfg.probe_every

    def draft_len(self) -> int:
        """How many tokens to draft for the next verify step (0: a plain step)."""
        if not self.cfg.adaptive:
            return self.cfg.num_draft
        if self.k == 0 and self.probe and self._since_off >= self.cfg.probe_every:
            return self.probe
        return self.k

    def record(self, drafted: int, accepted: int, rejected: int | None = None) -> None:
        """One step of the speculative path: `drafted` tokens proposed, `accepted` of them kept, `rejected` 1 when a
        drafted token was refused (default: whenever fewer than drafted were kept)."""
        s = self.stats
        if self.trace is not None:
            self.trace.append(drafted)
        if drafted == 0:
            s.plain_steps += 1
            if self.k == 0:
                self._since_off += 1
            return
        if rejected is None:
            rejected = int(accepted < drafted)
        s.verify_steps += 1
        s.drafted += drafted
        s.accepted += accepted
        s.rejected += rejected
        keep = 1.0 - self.cfg.ewma_alpha
        self._acc = keep * self._acc + accepted
        self._rej = keep * self._rej + rejected
        if self.cfg.adaptive:
            self._choose()

    def _choose(self) -> None:
        cfg, h = self.cfg, self.cfg.hysteresis
        k, gain = best_k(self.rate, cfg)
        if self.k == 0:
            if gain > 1.0 + cfg.min_gain:
                self.k = k
            self._since_off = 0
            return
        now = speedup(self.rate, self.k, cfg.verify_cost, cfg.draft_cost)
        if best_k(self._upper(), cfg)[1] < 1.0 + cfg.min_gain - h:
            self.k, self._since_off = 0, 0
        elif gain > now + h / 4:
            self.k = k
