"""Drafters for speculative decoding on a decode node: prompt lookup (n-gram matches in the prompt and the text so
far, no model) and a draft model of the same tokenizer (greedy drafts over its own cache, mlx-lm's way).

Both draft deterministically (a one-hot draft distribution), so the verifier's accept rule is the target's own
sampler: a drafted token is kept when the target samples it, which keeps the target's distribution exactly.
"""

from __future__ import annotations


class PromptLookup:
    """Drafts the tokens that followed the latest earlier occurrence of the sequence's longest suffix n-gram
    (ngram_max down to ngram_min). An index per n keeps the lookup O(1) per token on a 25k-token prompt.
    A DraftSource (sources.py): `match_len` is the n of the n-gram the last draft matched (0: none)."""

    name = "prompt_lookup"
    MAX_EXTENT = 32  # past the last bucket's lower bound (16): no need to look further

    def __init__(self, seq: list[int], ngram_min: int, ngram_max: int) -> None:
        self.seq = seq  # shared with the runner: it appends every token it emits
        self.match_len = 0
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self.index: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # n-grams ending before this position are in the index

    def _catch_up(self) -> None:
        """Index every n-gram ending at j for j <= len(seq) - 2 (a continuation token follows each)."""
        seq = self.seq
        for j in range(self._indexed, len(seq) - 1):
            for n, idx in self.index.items():
                if j + 1 >= n:
                    idx[tuple(seq[j + 1 - n:j + 1])] = j  # later occurrences win: the nearest context
        self._indexed = max(self._indexed, len(seq) - 1)

    def draft(self, k: int) -> list[int]:
        self.match_len = 0
        if k <= 0:
            return []
        self._catch_up()
        seq = self.seq
        for n in self.sizes:
            if len(seq) < n:
                continue
            j = self.index[n].get(tuple(seq[-n:]))
            if j is not None:
                self.match_len = self._extent(j, n)
                return seq[j + 1:j + 1 + k]
        return []

    def _extent(self, j: int, n: int) -> int:
        """How far the match ending at j reaches back past its n-gram (up to MAX_EXTENT): a 2-gram that is the tail
        of a 20-token quote is a long match, one that is not is likely chance."""
        seq, length, end = self.seq, n, len(self.seq) - 1
        while length < self.MAX_EXTENT and j - length >= 0 and seq[j - length] == seq[end - length]:
            length += 1
        return length

    def prefill_step(self) -> bool:
        """Nothing to prefill (False: the verify step may run)."""
        return False

    def accepted(self, kept: int) -> None:
        """Nothing to rewind: the index only ever holds the real sequence."""

    def close(self) -> None:
        pass


class DraftModel:
    """Greedy drafts from a small model over its own cache. The draft model prefills the whole sequence itself
    (bridged KV and the prefix cache hold only the target's KV), a chunk per loop step (`prefill_step`) so an
    arriving request waits at most one chunk; after a verify step its cache is trimmed back to the tokens the
    target kept, as mlx-lm's speculative_generate_step rewinds it (a refused trim raises: never draft on from a
    cache holding refused tokens)."""

    PREFILL_CHUNK = 512
    name = "draft"
    match_len = 0  # a model matches no context suffix: its acceptance is kept in the first bucket

    def __init__(self, model, seq: list[int], draft_cost: float = 0.0) -> None:  # cost: the config's prior
        from mlx_lm.models.cache import make_prompt_cache

        from kv_bridge.mlx.cache import rollback_caches

        self.model, self.seq, self.draft_cost = model, seq, draft_cost
        self.cache = rollback_caches(make_prompt_cache(model))
        self.fed = 0  # seq[:fed] is in the draft cache
        self._pending: list[int] = []  # drafted tokens run through the draft cache, not yet kept or refused
        self._saved: list = []  # per layer: a sliding layer's state before the drafts (None: trims as it is)

    def _feed(self, tokens: list[int]):
        import mlx.core as mx

        logits = None
        for i in range(0, len(tokens), self.PREFILL_CHUNK):
            logits = self.model(mx.array([tokens[i:i + self.PREFILL_CHUNK]]), cache=self.cache)
        return logits[0, -1]

    def prefill_step(self) -> bool:
        """One chunk of the sequence's prefix (all but its last token) into the draft cache; False once done."""
        import mlx.core as mx

        end = min(self.fed + self.PREFILL_CHUNK, len(self.seq) - 1)
        if end <= self.fed:
            return False
        self.model(mx.array([self.seq[self.fed:end]]), cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.fed = end
        return True

    def draft(self, k: int) -> list[int]:
        import mlx.core as mx

        if k <= 0:
            return []
        logits = self._feed(self.seq[self.fed:])
        self.fed = len(self.seq)
        # A sliding layer's ring cannot drop one-token updates past its window: keep its state as it is now (a
        # slice is a new array; the ring's in-place writes do not reach it) to go back to if the trim cannot.
        self._saved = [tuple(x[:] if hasattr(x, "shape") else x for x in c.state) if hasattr(c, "rollback_room")
                       and c.keys is not None else None for c in self.cache]
        out: list[int] = []
        while True:
            t = int(mx.argmax(logits).item())
            out.append(t)
            if len(out) == k:
                break
            logits = self._feed([t])
        self._pending = out[:-1]  # the last drafted token was never run through the draft model
        return out

    def accepted(self, kept: int) -> None:
        """The target kept `kept` drafted tokens (already appended to seq): keep as many of those the draft cache
        ran and trim the rest; where a sliding layer cannot, go back to the cache before the drafts (the kept ones
        are fed again with the next draft). At least the newest token of seq stays unfed: the next draft's logits
        come from feeding it (a plain step's one token may be a kept draft the cache already ran)."""
        keep = max(0, min(kept, len(self._pending), len(self.seq) - 1 - self.fed))
        drop, ran = len(self._pending) - keep, len(self._pending)
        rings = [c.rollback_room() for c, s in zip(self.cache, self._saved) if s is not None]
        if drop <= min(rings, default=drop):
            self._trim(drop)
            self.fed += keep
        else:
            for c, saved in zip(self.cache, self._saved):
                if saved is not None:
                    c.state = saved
                elif c.trim(ran) != ran:
                    raise RuntimeError("the draft model's cache could not drop its drafted tokens")
        self._pending, self._saved = [], []

    def _trim(self, n: int) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        if trim_prompt_cache(self.cache, n) != n:
            raise RuntimeError("the draft model's cache could not drop the refused drafted tokens")

    def close(self) -> None:
        self.cache = None


def load_draft(path: str, target_tokenizer, vocab_size: int):
    """The draft model for `path`; refuses (ValueError, at start-up) a draft whose tokenizer differs."""
    from mlx_lm import load

    model, tok = load(path)
    if tok.vocab != target_tokenizer.vocab:
        raise ValueError(f"draft model {path} has a different tokenizer from its target: speculative.draft_path "
                         "needs a model of the same tokenizer")
    width = getattr(getattr(model, "args", None), "vocab_size", None) or len(tok.vocab)
    if width != vocab_size:
        raise ValueError(f"draft model {path} has {width} logits, its target {vocab_size}")
    return model


def truncated_draft(src: str, dst: str, keep: list[int]) -> str:
    """A draft model built from its target by keeping only the decoder layers `keep` (indices into the target's
    layers, in order): same tokenizer, embeddings and final norm, no training. Honest about what it is: a
    layer-skipping self-draft (as in Draft & Verify, Zhang et al. 2023), far weaker than a trained small sibling.
    Writes an MLX-loadable folder at `dst` and returns it."""
    import json
    import re
    import shutil
    from pathlib import Path

    import mlx.core as mx

    s, d = Path(src), Path(dst)
    d.mkdir(parents=True, exist_ok=True)
    for f in s.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, d / f.name)
    cfg = json.loads((s / "config.json").read_text())
    cfg["num_hidden_layers"] = len(keep)
    cfg["_draft_of"] = {"path": str(s), "layers": list(keep)}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    weights = {}
    for f in sorted(s.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    new = {i: j for j, i in enumerate(keep)}
    out = {}
    for name, w in weights.items():
        m = re.match(r"(.*\.layers\.)(\d+)(\..*)", name)
        if m is None:
            out[name] = w
        elif int(m.group(2)) in new:
            out[f"{m.group(1)}{new[int(m.group(2))]}{m.group(3)}"] = w
    mx.save_safetensors(str(d / "model.safetensors"), out, metadata={"format": "mlx"})
    return str(d)
