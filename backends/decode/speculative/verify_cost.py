"""The verify cost a decode node measures on itself, per model: wall seconds of the forwards it already runs (a plain
step's one row, a verify step's k + 1), bucketed by context depth, a running median of the last samples of each.
The controller weighs drafts at the measured ratio; the config's verify_cost is the prior until samples exist.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

DEPTHS = (2048, 8192, 16384)  # context-depth bucket edges (tokens): the KV a verify re-reads grows with depth
DEPTH_NAMES = ("0-2k", "2k-8k", "8k-16k", "16k+")
WINDOW = 64  # samples kept per (rows, depth): a median over the recent ones, robust to a stalled step
MAX_ROWS = 17  # verify steps of up to 16 drafted tokens (SpeculativeConfig.num_draft's bound)


def depth_bucket(depth: int) -> int:
    for i, edge in enumerate(DEPTHS):
        if depth < edge:
            return i
    return len(DEPTHS)


class VerifyCost:
    """Step seconds by (query rows, depth bucket). The MLX thread adds samples; /metrics reads a snapshot.

    `ratio(k, depth)`: a verify step over k drafted tokens (k + 1 rows) in plain steps, 1 + c * k with c fitted to
    the medians of each k' + 1-row size over the 1-row median at that depth (or the nearest depth holding both),
    once the 1-row steps and the verify steps (of any sizes) each number `min_samples`; until then the prior
    1 + k * prior_cost. c >= 0: more rows cannot honestly cost
    less, a ratio under 1 is noise. A plain step's sample is a pipelined step's (one token's interval while the next forward
    is already built), a verify step's its whole wall time (forward, accept, trim): what each costs the generation."""

    def __init__(self, prior_cost: float, min_samples: int = 8) -> None:
        self.prior_cost, self.min_samples = prior_cost, min_samples
        self._samples: dict[tuple[int, int], deque] = {}
        self._median: dict[tuple[int, int], tuple[float, int]] = {}  # cached per key until its next sample
        self._fits: dict[int, float | None] = {}  # depth bucket asked -> c, until the next sample (MLX thread)
        self._lock = threading.Lock()  # /metrics copies while the MLX thread appends
        self._batch: dict[int, deque] = {}  # batch size -> a batch step's seconds (the plain batch, nothing else)
        self._path: deque = deque(maxlen=4 * WINDOW)  # the speculative path's decode steps: (tokens, seconds)

    def add(self, rows: int, depth: int, seconds: float) -> None:
        if seconds <= 0 or rows < 1:
            return
        key = (rows, depth_bucket(depth))
        with self._lock:
            self._samples.setdefault(key, deque(maxlen=WINDOW)).append(seconds)
            self._median.pop(key, None)
            self._fits.clear()

    def add_batch(self, size: int, seconds: float) -> None:
        with self._lock:
            self._batch.setdefault(size, deque(maxlen=WINDOW)).append(seconds)

    def add_path(self, tokens: int, seconds: float) -> None:
        """One decode step of the speculative path, whatever it ran (plain, verify) and the tokens it emitted."""
        if seconds > 0:
            with self._lock:
                self._path.append((tokens, seconds))

    def path_rate(self) -> tuple[float, int] | None:
        """(tokens per second, steps) over the speculative path's recent decode steps, None without any."""
        with self._lock:
            got = list(self._path)
        seconds = sum(s for _, s in got)
        return (sum(t for t, _ in got) / seconds, len(got)) if seconds else None

    def batch_seconds(self, size: int) -> tuple[float, int] | None:
        """(median seconds, samples) of a batch step of `size` generations, None without samples."""
        with self._lock:
            got = list(self._batch.get(size, ()))
        return (statistics.median(got), len(got)) if got else None

    def seconds(self, rows: int, depth_index: int) -> tuple[float, int] | None:
        """(median seconds, samples) of (rows, depth bucket), None without samples."""
        key = (rows, depth_index)
        with self._lock:
            cached = self._median.get(key)
            if cached is None and self._samples.get(key):
                got = self._samples[key]
                cached = self._median[key] = (statistics.median(got), len(got))
        return cached

    def measured(self, k: int, depth: int) -> float | None:
        """The measured ratio of a verify step over k drafted tokens to a plain step, or None: 1 + c * k, c the
        per-drafted-token cost fitted over every k measured at the nearest depth that has `min_samples` 1-row steps
        and `min_samples` verify steps of any sizes (weighted by samples: one noisy k does not make k + 1 look
        cheaper)."""
        if not self._samples:
            return None
        want = depth_bucket(depth)
        if want not in self._fits:  # asked several times a step: fitted once per new sample
            self._fits[want] = self._fit(want)
        c = self._fits[want]
        return None if c is None else 1.0 + c * k

    def _fit(self, want: int) -> float | None:
        for d in sorted(range(len(DEPTHS) + 1), key=lambda i: abs(i - want)):
            one = self.seconds(1, d)
            if not one or one[1] < self.min_samples:
                continue
            # every verify size timed here counts, weighted by its samples: with k varying per step (1-3 on the site,
            # up to 9 on a GQA-3 model) no one size may reach min_samples for long, and the prior would rule meanwhile
            fit = [(rows - 1, got) for rows in range(2, MAX_ROWS + 1) if (got := self.seconds(rows, d))]
            if sum(n for _, (_, n) in fit) >= self.min_samples:
                return sum(n * max(0.0, t / one[0] - 1.0) for _, (t, n) in fit) / sum(n * j for j, (_, n) in fit)
        return None

    def plain_seconds(self, depth: int) -> float | None:
        """The median 1-row step at this depth, or the nearest depth measured; None before any."""
        if not self._samples:
            return None
        want = depth_bucket(depth)
        for d in sorted(range(len(DEPTHS) + 1), key=lambda i: abs(i - want)):
            got = self.seconds(1, d)
            if got:
                return got[0]
        return None

    def ratio(self, k: int, depth: int) -> float:
        """A verify step over k drafted tokens in plain steps (measured, else the prior)."""
        if k <= 0:
            return 1.0
        got = self.measured(k, depth)
        return got if got is not None else 1.0 + k * self.prior_cost

    def snapshot(self) -> list[tuple[int, str, float, int]]:
        """(rows, depth name, median seconds, samples) of every bucket with samples: what /metrics exports."""
        with self._lock:
            items = [(key, list(v)) for key, v in self._samples.items() if v]
        return [(rows, DEPTH_NAMES[d], statistics.median(v), len(v)) for (rows, d), v in sorted(items)]

    def costs(self) -> list[tuple[int, str, float]]:
        """(k, depth name, measured verify_cost = (ratio - 1) / k) where both sides have enough samples."""
        out = []
        rows = sorted({r for r, *_ in self.snapshot() if r > 1})
        for d, name in enumerate(DEPTH_NAMES):
            one = self.seconds(1, d)
            for r in rows:
                many = self.seconds(r, d)
                if one and many and min(one[1], many[1]) >= self.min_samples:
                    out.append((r - 1, name, max(0.0, (many[0] / one[0] - 1.0) / (r - 1))))
        return out
