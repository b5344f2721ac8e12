"""A decode node's speculative-decoding controller and counters, one per model: it picks the draft length from the
acceptance it measures (an EWMA of accepted/drafted), turns drafting off where it does not pay, and probes again.

Pure Python (no MLX): the MLX thread writes, /metrics reads plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_bridge.config.speculative import SpeculativeConfig


def expected_tokens(rate: float, k: int) -> float:
    """Tokens one verify step yields with k drafted tokens, each accepted with probability `rate` until the first
    rejection (Leviathan et al. 2023, eq. 1): 1 + r + ... + r^k (the target always adds one)."""
    return sum(rate ** i for i in range(k + 1))


def speedup(rate: float, k: int, verify_cost: float, draft_cost: float = 0.0) -> float:
    """Decode speedup over plain steps: tokens per step over the step's cost in plain-step units."""
    return expected_tokens(rate, k) / (1.0 + k * (verify_cost + draft_cost))


def best_draft(rate: float, cfg: SpeculativeConfig) -> int:
    """The draft length with the best expected speedup, 0 (off) when none beats plain decoding by cfg.min_gain."""
    gains = {k: speedup(rate, k, cfg.verify_cost, cfg.draft_cost) for k in range(1, cfg.num_draft + 1)}
    k = max(gains, key=gains.get)
    return k if gains[k] > 1.0 + cfg.min_gain else 0


@dataclass
class SpecStats:
    """Counters since start (MLX thread writes; /metrics reads). `requests[reason]`: generations by how they ran."""

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0  # target forwards over y + at least one drafted token
    plain_steps: int = 0  # forwards of the speculative path with nothing drafted (off, or no n-gram match)
    requests: dict[str, int] = field(default_factory=dict)

    def ran(self, reason: str) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + 1


class SpecController:
    """Per model: the draft length for the next step (`draft_len`), updated from each step's outcome (`record`).

    Acceptance is the EWMA of accepted/drafted over verify steps; the draft length is the k that maximises
    `speedup(rate, k, verify_cost)`; below 1 + min_gain drafting is off, and every `probe_every` plain steps one
    step drafts num_draft tokens to measure again (so a request that starts quoting its prompt turns it back on).
    """

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.stats = SpecStats()
        self.rate = 0.5  # prior acceptance: a fresh node drafts (best_draft(0.5) > 0 unless verify_cost is high)
        self.k = cfg.num_draft if not cfg.adaptive else best_draft(self.rate, cfg)
        self._since_off = 0

    @property
    def enabled(self) -> bool:
        return self.cfg.method != "off"

    def draft_len(self) -> int:
        """How many tokens to draft for the next verify step (0: a plain step)."""
        if not self.cfg.adaptive:
            return self.cfg.num_draft
        if self.k == 0 and self._since_off >= self.cfg.probe_every:
            return self.cfg.num_draft  # a probe
        return self.k

    def record(self, drafted: int, accepted: int) -> None:
        """One step of the speculative path: `drafted` tokens proposed, `accepted` of them kept."""
        s = self.stats
        if drafted == 0:
            s.plain_steps += 1
            if self.k == 0:
                self._since_off += 1
            return
        s.verify_steps += 1
        s.drafted += drafted
        s.accepted += accepted
        a = self.cfg.ewma_alpha
        self.rate = (1 - a) * self.rate + a * (accepted / drafted)
        if self.cfg.adaptive:
            self.k = best_draft(self.rate, self.cfg)
            self._since_off = 0
