"""Learned drafters as draft sources of a speculative generation: an EAGLE-3 head drafts token by token, a DFlash
drafter a block at once, both from the target's hidden states that the verify and prefill forwards already compute
(hidden.HiddenTap hands them over). Checks that refuse a drafter trained for another target, naming the field.
"""

from __future__ import annotations

LEARNED = ("eagle3", "dflash")
# The published learned drafters for the site models (docs/speculative.md, learned drafters, says why each): what
# `disagg models prepare --role draft` fetches to speculative.draft_path when no --mlx source is given.
_QWEN_CODER = ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8")
SITE_HEADS = {
    "eagle3": {"openai/gpt-oss-120b": "nvidia/gpt-oss-120b-Eagle3",
               **{m: "lmsys/SGLang-EAGLE3-Qwen3-Coder-30B-A3B-Instruct-SpecForge" for m in _QWEN_CODER}},
    "dflash": {"openai/gpt-oss-120b": "z-lab/gpt-oss-120b-DFlash",
               **{m: "z-lab/Qwen3-Coder-30B-A3B-DFlash" for m in _QWEN_CODER}},
}
_ROPE_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "low_freq_factor",
              "high_freq_factor")


def check_target(path: str, field: str, have, want) -> None:
    if have != want:
        raise ValueError(f"{path}: {field} is {have}, the decode model's is {want}: this drafter was trained for "
                         "another model; use the one published for this model (docs/speculative.md, learned drafters)")


def _rope(scaling: dict | None) -> dict | None:
    """A rope_scaling dict compared by what changes the rotation ("type" is the older name of "rope_type")."""
    if not scaling:
        return None
    s = {**scaling, "rope_type": scaling.get("rope_type", scaling.get("type"))}
    if s["rope_type"] in (None, "default"):
        return None
    return {k: (float(s[k]) if isinstance(s[k], (int, float)) and not isinstance(s[k], bool) else s[k])
            for k in _ROPE_KEYS if k in s}


def check_rope(path: str, theta: float, scaling: dict | None, target: dict) -> None:
    """NVIDIA's warning for its gpt-oss heads: a head whose RoPE differs from the target's loses acceptance at long
    context. Refused at start-up rather than found in the acceptance rate."""
    check_target(path, "rope_theta", float(theta), float(target["rope_theta"]))
    if _rope(scaling) != _rope(target["rope_scaling"]):
        raise ValueError(f"{path}: rope_scaling is {scaling}, the decode model's is {target['rope_scaling']}: the "
                         "head was trained for another context length or model; use the variant published for this "
                         "model's RoPE (docs/speculative.md, learned drafters)")


class HiddenSource:
    """The target's hidden states at positions next.. not yet consumed by the drafter, kept in order as forwards
    over the generation's cache arrive (a forward from position p replaces every row from p on: a refused draft's
    rows are overwritten by the next forward, never consumed, since only rows below the cache's offset are)."""

    PREFILL_CHUNK = 512

    def __init__(self, tap, seq: list[int], target_cache: list) -> None:
        self.tap, self.seq, self.target_cache = tap, seq, target_cache
        self.next: int | None = None  # target position of rows[0]
        self.rows = None  # (1, T, D)
        # a model matches no context suffix: one arm (the first bucket, as a draft model's), whatever k it drafts
        self.match_len = 0
        tap.listen(target_cache, self._observe)

    def _observe(self, start: int, hidden) -> None:
        if self.next is None:
            self.next = start
        if start < self.next:  # positions already consumed (never on the speculative path): keep what is new
            hidden = hidden[:, self.next - start:]
            start = self.next
            if hidden.shape[1] == 0:
                return
        have = 0 if self.rows is None else self.rows.shape[1]
        keep = start - self.next
        if keep > have:  # positions no forward here computed (bridged KV, a prefix-cache hit): the drafter's context
            self.rows, self.next = hidden, start  # skips them; RoPE is relative, so what it holds stays consistent
        else:
            import mlx.core as mx

            self.rows = hidden if keep == 0 else mx.concatenate([self.rows[:, :keep], hidden], axis=1)

    def _usable(self, limit: int) -> int:
        """Rows ready to consume: computed, below the target cache's offset (a trimmed refused draft is not) and
        below `limit`."""
        if self.rows is None:
            return 0
        return max(0, min(self.rows.shape[1], min(self.target_cache[0].offset, limit) - self.next))

    def _take(self, limit: int, most: int | None = None):
        """(start, rows (1, n, D)) for the rows below the cache's offset and `limit`, at most `most`; None if none."""
        n = self._usable(limit)
        if most is not None:
            n = min(n, most)
        if n <= 0:
            return None
        start, rows = self.next, self.rows[:, :n]
        self.rows = self.rows[:, n:] if n < self.rows.shape[1] else None
        self.next += n
        return start, rows

    def _install(self, start: int, keys, values, dtype, ropes) -> list:
        """The drafter's own prompt KV of positions [start, start + T) ((Ld, H, T, D) numpy) as its caches, one per
        layer; from `start` > 0 (a prefix the Mac held: the wire carries the rest) each layer's keys turned back by
        `start` positions with its RoPE (`ropes`), so the cache holds them at 0..T-1 and the context starts there, as
        wherever this node computed no state (RoPE scores depend on relative positions only). Target rows arrive
        from position start + T on."""
        from kv_bridge.mlx.cache import plain_caches

        cache = plain_caches(keys, values, dtype)
        if start:
            for c, rope in zip(cache, ropes):
                c.keys = rope_shift(rope, c.keys[..., :c.offset, :], -start)
        self.next = start + keys.shape[2]
        return cache

    def close(self) -> None:
        self.tap.listen(self.target_cache, None)
        self.rows = None


def rope_shift(rope, keys, by: int):
    """Keys (B, H, T, D) that RoPE rotated at positions p, as if rotated at p + by: one uniform rotation, the
    rope's own at position `by` applied to each row as a 1-long sequence, its magnitude scale (YaRN's mscale, which
    rope(x, offset=0) shows) divided out."""
    import mlx.core as mx

    rows = keys.transpose(2, 1, 0, 3)  # (T, H, B, D): each row alone, at offset 0 of its own sequence
    scale = rope(mx.ones((1, 1, 1, keys.shape[-1]), dtype=mx.float32), offset=0)
    shifted = (rope(rows.astype(mx.float32), offset=by) / scale).astype(keys.dtype)
    return shifted.transpose(2, 1, 0, 3)
