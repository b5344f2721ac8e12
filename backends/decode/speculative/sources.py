"""What a drafting source is (`DraftSource`), the registry of them by config name (`SOURCES`), the match-length
buckets the controller keeps acceptance in, and the draft length where MLX's attention stays fused.
Adding a source: write its module, then one line in SOURCES (name -> factory). docs/speculative.md, "Sources".
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from backends.decode.speculative.learned import LEARNED  # model-backed, one draft_path: named, never by "auto"

# Acceptance is kept per (source, bucket): a 2-token match in a 25k-token prompt is often chance (alpha ~0.1), a
# 20-token one a quote (alpha ~0.9). Upper bounds of each bucket's match length; a learned drafter names its own.
BUCKETS = ((1, 2), (3, 5), (6, 15), (16, None))
BUCKET_NAMES = tuple(f"{lo}-{hi}" if hi else f"{lo}+" for lo, hi in BUCKETS)
# MLX's fused decode attention (Metal sdpa_vector) takes query rows x GQA factor <= 32, head dims 64/96/128/256
# (mlx/backend/metal/scaled_dot_product_attention.cpp); past it attention writes out its scores (DESIGN.md).
FUSED_ROWS = 32
FUSED_HEAD_DIMS = (64, 96, 128, 256)


@runtime_checkable
class DraftSource(Protocol):
    """One drafting source of one generation (it sees the generation's token list, which the runner appends to).

    - `name`: the config name it is registered under (acceptance is kept per name).
    - `draft(k)`: up to k proposed next tokens, [] when it has nothing. After each call `match_len` says how long a
      suffix of the context the proposal was matched on (0: no proposal; a learned drafter sets a fixed bucket).
    - `accepted(kept)`: called once after every draft that returned tokens, before the next draft: how many of its
      proposal's leading tokens the target emitted (whether or not its proposal was the one verified).
    - `prefill_step()`: True while it still has its own prefill to run (a chunk per call); False: ready.
    - `close()`: the generation ended; free what it holds.
    - Optional `draft_cost` (float, default 0): one drafted token's cost in plain target steps (a draft model's).
      A source with a cost is asked to draft only when the controller would verify its proposal; free ones draft
      every step (their proposals are scored against what the target emitted even when not verified).
    """

    name: str
    match_len: int

    def draft(self, k: int) -> list[int]: ...

    def accepted(self, kept: int) -> None: ...

    def prefill_step(self) -> bool: ...

    def close(self) -> None: ...


def bucket(match_len: int) -> int:
    """The bucket index of a proposal matched on `match_len` context tokens (0 and 1 share the first)."""
    for i, (_, hi) in enumerate(BUCKETS):
        if hi is None or match_len <= hi:
            return i
    return len(BUCKETS) - 1


def fused_cap(heads: int | None, kv_heads: int | None, head_dim: int | None) -> int | None:
    """The most drafted tokens a verify forward may carry while attention stays on the fused kernel: (k + 1) x GQA
    <= 32, so k <= 32 / GQA - 1 (GQA 8: 3). None: no fused kernel to keep (an unsupported head dim, unknown shape,
    or a GQA factor past 16 where even two rows leave it): the measured cost alone decides."""
    if not heads or not kv_heads or head_dim not in FUSED_HEAD_DIMS:
        return None
    k = FUSED_ROWS // max(1, heads // kv_heads) - 1
    return k if k >= 1 else None


def model_cap(model) -> int | None:
    """fused_cap from an mlx-lm model's args (num_attention_heads, num_key_value_heads, head_dim)."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or (getattr(args, "hidden_size", 0) // heads if heads else None)
    return fused_cap(heads, kv_heads, head_dim)


def _prompt_lookup(m, seq: list[int], cfg, cache):
    from backends.decode.speculative.drafters import PromptLookup

    return PromptLookup(seq, cfg.ngram_min, cfg.ngram_max)


def _draft_model(m, seq: list[int], cfg, cache):
    from backends.decode.speculative.drafters import DraftModel

    if m.draft_model is None:  # "auto" without a draft_path: not configured
        return None
    return DraftModel(m.draft_model, seq, cfg.draft_cost)


def _suffix(m, seq: list[int], cfg, cache):
    from backends.decode.speculative.suffix import SuffixDrafter, SuffixStore

    if m.suffix_store is None:  # one per model: its earlier answers, across generations
        m.suffix_store = SuffixStore(cfg.suffix_store_tokens)
    return SuffixDrafter(seq, m.suffix_store)


def _learned(method: str):
    def factory(m, seq: list[int], cfg, cache):
        from backends.decode.speculative.learned_load import make_source

        if m.draft_model is None:  # loaded at start only where the config names this drafter (engine.py)
            return None
        return make_source(method, m.draft_model, m.model, seq, cache)
    return factory


# name -> factory(model: MLXModel, seq: the generation's token list, cfg: SpeculativeConfig, cache: the generation's
# target cache, which learned drafters read the offset of) -> DraftSource | None
# (None: not configured for this model, e.g. "draft" without a draft model). The config's `method` names these.
SOURCES: dict[str, Callable] = {
    "prompt_lookup": _prompt_lookup,
    "suffix": _suffix,
    "draft": _draft_model,
    "eagle3": _learned("eagle3"),
    "dflash": _learned("dflash"),
}


def load_models(m) -> None:
    """At a model's load (its MLX thread): the fused-attention cap on k, and the draft model or learned drafter a
    configured source needs (a learned one wraps the target to hand out the hidden states it reads: hidden.py)."""
    cfg = m.speculation.cfg
    m.draft_cap = model_cap(m.model)
    names = names_for(cfg)
    learned = [n for n in names if n in LEARNED]
    if "draft" in names and cfg.draft_path:
        from backends.decode.speculative.drafters import load_draft

        m.draft_model = load_draft(cfg.draft_path, m.tokenizer, m.vocab_size)
    elif learned:
        from backends.decode.speculative.learned_load import load_learned

        m.model, m.draft_model = load_learned(learned[0], cfg.draft_path, m.model)


def check_names(names: tuple[str, ...]) -> None:
    """At start-up: every name the config gives is a registered source (the fix in the message)."""
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise ValueError(f"speculative.method names {unknown}, not a drafting source this node has: use one of "
                         f"{sorted(SOURCES)}, a list of them, \"auto\" (all) or \"off\"")


def names_for(cfg) -> tuple[str, ...]:
    """The source names a config asks for ("auto": every registered one; "off": none)."""
    return tuple(n for n in SOURCES if n not in LEARNED) if cfg.sources == ("auto",) else cfg.sources


def make_sources(m, seq: list[int], cfg, cache=None) -> list:
    """The generation's sources, in the config's order; those not configured for this model (factory -> None) left out."""
    out = []
    for name in names_for(cfg):
        src = SOURCES[name](m, seq, cfg, cache)
        if src is not None:
            out.append(src)
    return out
