"""The drafting-source registry and interface (backends/decode/speculative/sources.py): buckets, the fused-attention
cap on k from a model's shape, names checked at start-up, and the sources a config builds."""

from __future__ import annotations

import pytest

from backends.decode.speculative import sources
from backends.decode.speculative.drafters import PromptLookup
from backends.decode.speculative.sources import (BUCKET_NAMES, DraftSource, bucket, check_names, fused_cap,
                                                 make_sources, model_cap)
from kv_bridge.config.speculative import SpeculativeConfig


def test_buckets():
    assert BUCKET_NAMES == ("1-2", "3-5", "6-15", "16+")
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 6, 15, 16, 400)] == [0, 0, 0, 1, 1, 2, 2, 3, 3]


def test_fused_cap_from_gqa_and_head_dim():
    """(k + 1) x GQA <= 32 on MLX's sdpa_vector: both site models (GQA 8) verify at most 3 drafted tokens."""
    assert fused_cap(32, 4, 128) == 3  # Qwen3-Coder-30B-A3B
    assert fused_cap(64, 8, 64) == 3  # gpt-oss-120b
    assert fused_cap(9, 3, 64) == 9  # SmolLM2-135M: GQA 3
    assert fused_cap(32, 32, 128) == 31  # no GQA
    assert fused_cap(32, 4, 80) is None  # sdpa_vector has no head dim 80: nothing fused to keep
    assert fused_cap(64, 2, 128) is None  # GQA 32: even k = 1 leaves it
    assert fused_cap(None, None, None) is None

    class Args:
        num_attention_heads, num_key_value_heads, head_dim = 32, 4, 128

    assert model_cap(type("M", (), {"args": Args})()) == 3


def test_names_are_checked_with_the_fix():
    check_names(("prompt_lookup", "draft"))
    with pytest.raises(ValueError, match=r"prompt_lookup.*\"auto\""):
        check_names(("prompt_lookup", "ngram"))


def test_make_sources_follows_the_config_and_skips_the_unconfigured():
    m = type("M", (), {"draft_model": None, "suffix_store": None})()
    seq = [1, 2, 3, 1, 2]
    got = make_sources(m, seq, SpeculativeConfig(method="auto"))
    assert [s.name for s in got] == ["prompt_lookup", "suffix"]  # "draft" has no draft model here: left out
    assert all(isinstance(s, DraftSource) for s in got) and got[0].draft(2) == [3, 1]
    assert m.suffix_store is not None  # the model's store of earlier answers, made on first use
    assert make_sources(m, seq, SpeculativeConfig()) == []


def test_a_registered_source_is_built_by_name(monkeypatch):
    """What registering a source takes: one entry in SOURCES; the config may then name it alone or in a list."""
    class Echo(PromptLookup):
        name = "echo"

    monkeypatch.setitem(sources.SOURCES, "echo", lambda m, seq, cfg, cache: Echo(seq, 1, 2))
    m = type("M", (), {"draft_model": None, "suffix_store": None})()
    got = make_sources(m, [5, 5], SpeculativeConfig(method=["echo", "prompt_lookup"]))
    assert [s.name for s in got] == ["echo", "prompt_lookup"]
    assert [s.name for s in make_sources(m, [5], SpeculativeConfig(method="auto"))][-1] == "echo"
