"""An EAGLE-3 head drafting for one generation (vLLM's eagle proposer, chain drafts): the head's own KV holds one entry
per target position p from (embedding of x[p+1], fused target state g[p]); each draft step feeds the head's own
output back as the next state. Drafted entries are dropped after drafting: the verified ones come back from the target.
"""

from __future__ import annotations

from backends.decode.speculative.learned import HiddenSource


class Eagle3Source(HiddenSource):
    """Greedy chain drafts (a one-hot draft distribution, so the verifier's accept rule keeps the target's). The
    prompt's state: the target's prefill forwards hand their hidden states over; `prefill_step` runs the head over
    them a chunk at a time; positions whose states this node never computed (bridged KV) are skipped."""

    name = "eagle3"

    def __init__(self, head, tap, seq: list[int], target_cache: list) -> None:
        from mlx_lm.models.cache import KVCache

        super().__init__(tap, seq, target_cache)
        self.head = head
        self.embed = head.embed_tokens if "embed_tokens" in head else tap.embed
        self.cache = [KVCache()]
        self.last = None  # (pre-norm output (1, 1, H), draft logits (1, V)) at the latest consumed position

    def install_prompt_kv(self, start: int, keys, values) -> bool:
        """The head's own KV of prompt positions [start, start + T) as the prefill node's head computed it
        ((1, H, T, D) numpy in the decode KV dtype), before any state arrived; False otherwise. From `start` > 0 (the
        Mac held the prompt's first `start` tokens): its keys turned back by `start` positions (HiddenSource._install).
        """
        cfg = self.head.cfg
        if start < 0 or self.next is not None or self.cache[0].offset != 0 or keys.shape[0] != 1:
            return False
        if keys.shape[1::2] != (cfg.num_key_value_heads, cfg.head_dim):
            raise ValueError(f"the prefill node's head KV has (heads, head_dim) {keys.shape[1::2]}, this node's head "
                             f"{(cfg.num_key_value_heads, cfg.head_dim)}: the two sides run different heads")
        self.cache = self._install(start, keys, values, self.head.fc.weight.dtype,
                                   [self.head.midlayer.self_attn.rope])
        return True

    def _consume(self, most: int | None = None) -> bool:
        """The head over the next ready rows; a row at position p needs x[p+1], so rows stop before len(seq) - 1."""
        import mlx.core as mx

        got = self._take(len(self.seq) - 1, most)
        if got is None:
            return False
        start, rows = got
        tokens = mx.array([self.seq[start + 1:start + 1 + rows.shape[1]]])
        out, logits = self.head(self.embed(tokens), self.head.fuse(rows), self.cache)
        self.last = (out[:, -1:], logits[:, -1])
        return True

    def prefill_step(self) -> bool:
        """One chunk of the prompt's states through the head while more than a chunk waits (fewer: `draft` takes
        them with the first draft)."""
        import mlx.core as mx

        if self._usable(len(self.seq) - 1) <= self.PREFILL_CHUNK:
            return False
        self._consume(self.PREFILL_CHUNK)
        mx.eval(self.last, [c.keys for c in self.cache])
        return True

    def draft(self, k: int) -> list[int]:
        import mlx.core as mx

        if k <= 0:
            return []
        self._consume()
        if self.last is None or self.next != len(self.seq) - 1:  # no state for the text so far (yet)
            return []
        out, logits = self.last
        drafts: list[int] = []
        fed = 0
        while True:
            drafts.append(int(self.head.to_target(mx.argmax(logits, axis=-1)).item()))
            if len(drafts) == k:
                break
            out, logits = self.head(self.embed(mx.array([drafts[-1:]])), out, self.cache)
            logits = logits[:, -1]
            fed += 1
        if fed and self.cache[0].trim(fed) != fed:  # drafted entries: the target's states replace them
            raise RuntimeError("the EAGLE-3 head's cache could not drop its drafted entries")
        return drafts

    def accepted(self, kept: int) -> None:
        """Nothing to rewind: drafted entries are already gone; the kept tokens' states arrive with the next
        forward's rows (the verify's own rows beyond the kept ones lie above the trimmed cache and are replaced)."""

    def close(self) -> None:
        super().close()
        self.cache = self.last = None


def head_prompt_kv(head, tap, ids: list[int]):
    """The head's own KV of a prompt as this node computes it (its MLX prefill): the target over `ids`, the head over
    positions [0, len(ids) - 1) (each reads the next token). (K, V) float32 numpy (H, T, D): the reference the
    prefill node's head KV is checked against (same rows, same RoPE positions)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache, got = make_prompt_cache(tap.model), []
    tap.listen(cache, lambda start, hidden: got.append(hidden))
    try:
        tap(mx.array([ids[:-1]]), cache=cache)  # causal: the states of positions [0, n - 1) need no more
    finally:
        tap.listen(cache, None)
    embed = head.embed_tokens if "embed_tokens" in head else tap.embed
    own = [KVCache()]
    head(embed(mx.array([ids[1:]])), head.fuse(got[0]), own)
    c, n = own[0], len(ids) - 1
    return tuple(np.array(a[0, :, :n].astype(mx.float32)) for a in (c.keys, c.values))
