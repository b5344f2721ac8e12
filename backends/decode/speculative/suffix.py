"""Suffix decoding (SuffixDecoding, Oliinik et al. 2024; vLLM's `suffix` method): drafts the continuation that most
often followed the longest suffix of the text so far, in the generation's own prompt and text and in the model's
earlier answers (a per-model store, bounded in tokens, oldest answers evicted first).

Written here, not taken from arctic-inference (the implementation vLLM calls): on PyPI its suffix tree (C++, nanobind)
ships only as a source release that builds against torch >= 2.10 with CMake (0.3.0, checked 2026-11-28); its only
wheels (0.0.4, pure Python) have no suffix decoding, and a Mac decode node has no torch. So no install works on both
macOS arm64 and Linux; this module is pure Python and matches arctic's scoring (below).

How it scores (arctic-inference `SuffixTree::speculate`, `_speculate_path`): for each match length m of the context's
suffix, the occurrences of that m-gram are the suffix tree's node; the draft walks to the most frequent next token,
the path's probability multiplied by count(child) / count(node) at each step, and stops before a token whose path
probability drops under `min_prob` (vLLM's default 0.1) or after min(k, m x `factor`) tokens; the score is the sum of
the path's probabilities, and the best score over m wins (ties: the longer match). A tree's node counts are not kept:
they are counted at lookup over the positions where the m-gram ends, found through an index of where each n-gram of a
few anchor lengths ends (the `recent` latest per n-gram, so a count is exact up to that many occurrences). Appending a
token costs one index entry per anchor length (O(1), a 25k-token prompt is never rebuilt); a lookup costs
O(anchors x recent x depth) at most.

Privacy: the store holds one model's earlier answers, whoever asked. An answer only ever *proposes* tokens; the model
verifies every one and keeps it only where it would have produced it itself, so nothing of one client's answer can
reach another's output that the model would not have written anyway.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

END = -1  # separates answers in the store: no n-gram spans it, no continuation crosses it
ANCHORS = (1, 3, 8)
RECENT = 32
MAX_DEPTH = 24        # vLLM's suffix_decoding_max_tree_depth: the longest match looked for
MIN_PROB = 0.1        # vLLM's suffix_decoding_min_token_prob
FACTOR = 1.0          # vLLM's suffix_decoding_max_spec_factor: at most m x factor tokens after a match of m
INDEX_CHUNK = 4096     # prompt tokens indexed per prefill_step (~10 ms here)
STORE_TOKENS = 250_000  # a class of 60 answers of ~3,500 tokens; ~90 B a token on class text, 590 all-distinct


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixIndex:
    """Where each n-gram (n in `anchors`) ends in a token list that grows at its end and may drop whole answers at
    its front (positions are global: `base` is the position of tokens[0]). Positions below `base` are skipped at
    lookup and rebuilt away once they outnumber the live ones, so memory stays within twice the live tokens."""

    def __init__(self, tokens: list[int] | None = None, anchors: tuple[int, ...] = ANCHORS, recent: int = RECENT):
        if not anchors or min(anchors) < 1:
            raise ValueError(f"suffix anchors must be positive n-gram lengths, got {anchors}")
        if recent < 1:
            raise ValueError(f"suffix recent must be >= 1, got {recent}")
        self.tokens = tokens if tokens is not None else []  # may be the runner's own list: it appends, we read
        self.anchors = tuple(sorted(set(anchors), reverse=True))
        self.recent = recent
        self.maps: dict[int, dict[tuple, list[int]]] = {n: {} for n in self.anchors}
        self.base = 0
        self.indexed = 0  # global: n-grams ending before this position are in the maps
        self.stale = 0    # positions below base still in the maps

    def catch_up(self, most: int | None = None) -> bool:
        """Index every n-gram ending at p <= the last position but one (a continuation token follows each), or the
        next `most` of them; True while some remain."""
        toks, base = self.tokens, self.base
        end = base + len(toks) - 1
        stop = end if most is None else min(end, self.indexed + most)
        for p in range(self.indexed, stop):
            i = p - base
            if toks[i] == END:
                continue
            for n, m in self.maps.items():
                if i + 1 >= n:
                    gram = tuple(toks[i + 1 - n:i + 1])
                    if END not in gram:
                        m.setdefault(gram, []).append(p)
        self.indexed = max(self.indexed, stop)
        return self.indexed < end

    def drop_front(self, n: int) -> None:
        """Forget the first n tokens (the oldest answers)."""
        del self.tokens[:n]
        self.base += n
        self.stale += n
        if self.stale > len(self.tokens):
            self.maps = {a: {} for a in self.anchors}
            self.indexed, self.stale = self.base, 0
            self.catch_up()

    def _match(self, p: int, ctx: list[int], at_least: int, depth: int) -> int:
        """How many tokens of ctx's suffix end at position p (at least `at_least`: the anchor matched)."""
        toks, base, m = self.tokens, self.base, at_least
        limit = min(depth, len(ctx))
        while m < limit:
            i = p - m - base
            if i < 0 or toks[i] != ctx[-1 - m]:
                break
            m += 1
        return m

    def candidates(self, ctx: list[int], depth: int) -> dict[int, dict[int, int]]:
        """Per anchor n: {position: match length} for the `recent` latest occurrences of ctx's last n tokens,
        latest first."""
        out: dict[int, dict[int, int]] = {}
        known: dict[int, int] = {}
        cap = depth  # a longer match is counted from the longer anchor's sample: no need to measure past it here
        for n in self.anchors:
            if len(ctx) < n:
                continue
            positions = self.maps[n].get(tuple(ctx[-n:]))
            if not positions:
                continue
            found = {}
            for p in reversed(positions[-self.recent:]):
                if p < self.base:
                    break
                if p not in known:
                    known[p] = self._match(p, ctx, n, cap)
                found[p] = known[p]
            if found:
                out[n] = found
                cap = n
        return out

    def path(self, alive: list[int], n_max: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation after positions `alive` (latest first: ties go to the latest), and its
        score: the sum of each token's path probability, stopping before one under min_prob."""
        toks, base = self.tokens, self.base
        out: list[int] = []
        prob, score = 1.0, 0.0
        for step in range(n_max):
            counts: dict[int, int] = {}
            for p in alive:
                i = p + 1 + step - base
                if i < len(toks) and toks[i] != END:
                    counts[toks[i]] = counts.get(toks[i], 0) + 1
            if not counts:
                break
            t, c = max(counts.items(), key=lambda kv: kv[1])
            prob *= c / len(alive)
            if prob < min_prob:
                break
            out.append(t)
            score += prob
            alive = [p for p in alive if p + 1 + step - base < len(toks) and toks[p + 1 + step - base] == t]
        return out, score

    def lookup(self, ctx: list[int], k: int, depth: int = MAX_DEPTH, min_prob: float = MIN_PROB,
               factor: float = FACTOR, offset: float = 0.0) -> Draft:
        """The best-scored draft of at most k tokens over every match length of ctx's suffix (SuffixDecoding)."""
        best = Draft()
        if k <= 0:
            return best
        by_anchor = self.candidates(ctx, depth)
        lengths = sorted({m for found in by_anchor.values() for m in found.values()})
        for m in lengths:
            n_max = min(k, int(m * factor + offset + 1e-6))
            if n_max <= 0:
                continue
            # the m-gram's occurrences: from the longest anchor's sample that can hold them (a uniform recent sample)
            a = max(n for n in by_anchor if n <= m)
            alive = [p for p, length in by_anchor[a].items() if length >= m]
            tokens, score = self.path(alive, n_max, min_prob)
            if tokens and score >= best.score:
                best = Draft(tokens, score, m)
        return best


class SuffixStore:
    """One model's earlier answers (`add` one when its generation finishes), at most `max_tokens` tokens: the
    oldest answers are dropped first. Thread-safe (a node may finish one model's generations on its own thread)."""

    def __init__(self, max_tokens: int = STORE_TOKENS, anchors: tuple[int, ...] = ANCHORS, recent: int = RECENT):
        if max_tokens < 2:
            raise ValueError(f"a suffix store needs room for at least one token, got max_tokens={max_tokens}")
        self.max_tokens = max_tokens
        self.index = SuffixIndex(anchors=anchors, recent=recent)
        self._sizes: deque[int] = deque()  # each stored answer's length with its END, oldest first
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return sum(self._sizes)

    @property
    def answers(self) -> int:
        return len(self._sizes)

    def add(self, tokens: list[int]) -> None:
        """Store an answer (its tail, when longer than the store); evict the oldest answers past max_tokens."""
        tokens = [int(t) for t in tokens][-(self.max_tokens - 1):]
        if not tokens:
            return
        with self._lock:
            self.index.tokens.extend(tokens)
            self.index.tokens.append(END)
            self.index.catch_up()
            self._sizes.append(len(tokens) + 1)
            held = sum(self._sizes)
            drop = 0
            while held - drop > self.max_tokens:
                drop += self._sizes.popleft()
            if drop:
                self.index.drop_front(drop)

    def lookup(self, ctx: list[int], k: int, **kw) -> Draft:
        with self._lock:
            return self.index.lookup(ctx, k, **kw)


class SuffixDrafter:
    """A generation's suffix drafter (the drafting-source interface: `draft`, `match_len`, `prefill_step`,
    `accepted`, `close`): the best of its own prompt-and-text index and the model's store. Call `finish()` when the
    generation completes (EOS, max_tokens, a stop) to add its answer to the store; a cancelled or failed generation
    is not stored."""

    name = "suffix"

    def __init__(self, seq: list[int], store: SuffixStore | None = None, depth: int = MAX_DEPTH,
                 min_prob: float = MIN_PROB, factor: float = FACTOR, anchors: tuple[int, ...] = ANCHORS,
                 recent: int = RECENT) -> None:
        if depth < 1:
            raise ValueError(f"suffix depth must be >= 1, got {depth}")
        self.seq = seq  # shared with the runner: it appends every token it emits
        self.store = store
        self.prompt_len = len(seq)
        self.own = SuffixIndex(seq, anchors, recent)
        self.depth, self.min_prob, self.factor = depth, min_prob, factor
        self.match_len = 0
        self.source = ""  # "prompt" (the generation's own text) or "store" (earlier answers): the last draft's
        self._finished = False

    def draft(self, k: int) -> list[int]:
        self.match_len, self.source = 0, ""
        if k <= 0:
            return []
        self.own.catch_up()
        ctx = self.seq[-self.depth:]
        kw = {"depth": self.depth, "min_prob": self.min_prob, "factor": self.factor}
        own = self.own.lookup(ctx, k, **kw)
        other = self.store.lookup(ctx, k, **kw) if self.store is not None else Draft()
        best, self.source = (own, "prompt") if own.score >= other.score else (other, "store")
        if not best.tokens:
            self.source = ""
            return []
        self.match_len = best.match_len
        return best.tokens

    def prefill_step(self) -> bool:
        """Index the next INDEX_CHUNK prompt tokens (a 25k-token prompt in a few loop steps, so an arriving request
        waits at most one chunk); False once the prompt is indexed (the verify step may run)."""
        return self.own.catch_up(INDEX_CHUNK)

    def accepted(self, kept: int) -> None:
        """Nothing to rewind: the index only ever holds the real sequence."""

    def finish(self) -> None:
        """The generation completed: its answer (the tokens after the prompt) joins the model's store, once."""
        if self.store is not None and not self._finished:
            self.store.add(self.seq[self.prompt_len:])
        self._finished = True

    def close(self) -> None:
        pass
