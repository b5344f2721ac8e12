"""Decode-side prefix reuse: finished generations' mlx-lm caches kept in mlx-lm's LRUPromptCache under a byte bound,
so a conversation's next turn needs KV (from a prefill node, or computed here) only past what this node holds.

Threads: `match` takes no MLX op, so the event loop may call it to answer `kv_start` at once; `take`, `lookup` and
`store` touch mx arrays and run on the model's MLX thread. A lock keeps the two sides off each other's trie walk.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

# The byte bound is what limits the store; this only keeps the LRU's entry count from mattering.
_MAX_ENTRIES = 1 << 16


@dataclass
class Prefix:
    """A usable prefix: the first `tokens` prompt tokens' KV is `source` (a stored cache) less its last `trim`."""

    tokens: int
    source: list  # owned by the store and never mutated: `take` hands out a trimmed deep copy
    trim: int


class PrefixStore:
    """mlx-lm prompt caches by token sequence, per model key; `max_bytes` 0 turns the store off."""

    def __init__(self, max_bytes: int):
        self.enabled = max_bytes > 0
        self._lru = LRUPromptCache(max_size=_MAX_ENTRIES, max_bytes=max(max_bytes, 1))
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, model: str, ids: list[int], limit: int) -> Prefix | None:
        """The longest prefix of ids[:limit] whose KV is held, or None. No MLX op: safe on any thread.

        A stored sequence that extends past the shared prefix (the previous turn's generation) is usable only if
        its caches can be trimmed; a sliding-window cache that has wrapped cannot, so it serves only when the
        stored sequence is itself a prefix of ids[:limit].
        """
        if not self.enabled or limit <= 0:
            return None
        key = list(ids[:limit])
        with self._lock:
            # LRUPromptCache.fetch_nearest_cache would deep-copy (an MLX op); its trie answers the same question
            # without one, so the copy can wait for the MLX thread.
            found = self._lru._trie.search(model, key)
            if found.exact is not None:
                return Prefix(len(key), self._lru._trie.get(model, key).prompt_cache, 0)
            best = None
            if found.shorter is not None:
                best = Prefix(len(found.shorter), self._lru._trie.get(model, found.shorter).prompt_cache, 0)
            if found.longer is not None and found.common_prefix > (best.tokens if best else 0):
                cache = self._lru._trie.get(model, found.longer).prompt_cache
                if can_trim_prompt_cache(cache):
                    best = Prefix(found.common_prefix, cache, len(found.longer) - found.common_prefix)
        return best

    @staticmethod
    def take(prefix: Prefix) -> list:
        """A private copy of the prefix's caches holding exactly its tokens (MLX thread): generation may mutate it."""
        cache = copy.deepcopy(prefix.source)
        if prefix.trim and trim_prompt_cache(cache, prefix.trim) != prefix.trim:
            raise RuntimeError(f"prefix cache refused to trim {prefix.trim} tokens")
        return cache

    def lookup(self, model: str, ids: list[int], limit: int) -> tuple[int, list | None]:
        """(P, cache): a private cache holding the KV of ids[:P], P <= limit, or (0, None). MLX thread."""
        prefix = self.match(model, ids, limit)
        if prefix is None:
            return 0, None
        return prefix.tokens, self.take(prefix)

    def store(self, model: str, tokens: list[int], cache: list) -> None:
        """Keep a finished generation's cache (MLX thread; the caller must not touch `cache` afterwards).

        `tokens` is everything fed to the model: prompt + generated. Whether mlx-lm already ran the last sampled
        token through the model depends on how its loop ended, so the cache's own offset says how many it holds.
        """
        if not self.enabled or not cache:
            return
        held = cache[0].offset
        if not 0 < held <= len(tokens):
            raise ValueError(f"cache holds {held} tokens but only {len(tokens)} were fed")
        with self._lock:
            self._lru.insert_cache(model, list(tokens[:held]), cache)
