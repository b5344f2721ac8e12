"""PrefixStore with real mlx-lm caches: hits, misses, partial (trimmed) hits, copies that generation may mutate,
the byte bound, and sliding-window caches that cannot be trimmed once they wrapped.

References are MLX's own prefill of the same tokens, never the store's output. The model is a tiny random llama
(tests/support/tiny_models.py): the store's mechanics do not depend on trained weights, and a continuation is compared by
its logits as well as its greedy tokens, which a wrong cache cannot match by luck."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from tests.support import tiny_models
from backends.decode.prefix_cache import PrefixStore
from kv_bridge.mlx.cache import append_kv, cache_kv

TEXT = ("The quick brown fox jumps over the lazy dog while the committee debates the annual budget for rivers, "
        "mountains and the history of early computing machines in a small town by the sea. Everyone agreed.")
M = "m"


def prefill(model, ids: list[int]) -> list:
    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def kv(cache: list, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(L, H, n, D) K and V held by a cache list (KVCache layers)."""
    return (np.stack([np.array(c.state[0][0, :, :n]) for c in cache]),
            np.stack([np.array(c.state[1][0, :, :n]) for c in cache]))


def greedy(model, cache: list, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens continuing `cache` (which holds the KV before ids) over ids, and each step's logits."""
    out, logits, y = [], [], mx.array(ids)[None]
    for _ in range(steps):
        last = model(y, cache=cache)[0, -1]
        logits.append(np.array(last))
        out.append(int(mx.argmax(last).item()))
        y = mx.array([[out[-1]]])
    return out, np.stack(logits)


def same(ours: tuple[list[int], np.ndarray], ref: tuple[list[int], np.ndarray], tol: float = 1e-4) -> bool:
    """Same greedy tokens and the same logits at every step (float32: only summation order differs)."""
    return ours[0] == ref[0] and np.allclose(ours[1], ref[1], rtol=0, atol=tol)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model, tokenizer): a tiny random llama (KVCache layers) with SmolLM2's tokenizer."""
    return load(str(tiny_models.build("llama", tmp_path_factory.mktemp("llama") / "llama")))


def close(got, ref):
    """Equal up to rounding: an optimized BLAS (OpenBLAS under mlx-cpu, backends/host_blas.py; Metal on a Mac) rounds a
    token's row by how many rows its prefill ran with, so 10 tokens prefilled alone and the first 10 of 16 differ in
    the last bits. A wrong trim or a misplaced append would hand out another position's KV: far outside this."""
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(llama):
    model, tok = llama
    ids = tok.encode(TEXT)
    assert len(ids) >= 36
    return model, ids


def test_hit_continues_like_a_fresh_prefill(tiny):
    model, ids = tiny
    store = PrefixStore(1 << 30)
    store.store(M, ids[:12], prefill(model, ids[:12]))
    p, cache = store.lookup(M, ids, len(ids) - 1)
    assert p == 12 and all(c.offset == 12 for c in cache)
    assert same(greedy(model, cache, ids[12:], 4), greedy(model, make_prompt_cache(model), ids, 4))


def test_miss_and_disabled(tiny):
    model, ids = tiny
    store = PrefixStore(1 << 30)
    assert store.lookup(M, ids, 10) == (0, None)  # empty
    store.store(M, ids[:8], prefill(model, ids[:8]))
    assert store.lookup(M, [ids[0] + 1] + ids[1:], 10) == (0, None)  # first token differs
    assert store.lookup("other-model", ids, 10) == (0, None)
    off = PrefixStore(0)
    off.store(M, ids[:8], prefill(model, ids[:8]))
    assert len(off) == 0 and off.lookup(M, ids, 10) == (0, None)


def test_partial_hit_is_trimmed_to_the_shared_prefix(tiny):
    """Stored: the previous turn (longer); asked: a prompt that diverges after 10 tokens -> exactly 10 tokens."""
    model, ids = tiny
    store = PrefixStore(1 << 30)
    store.store(M, ids[:16], prefill(model, ids[:16]))
    other = ids[:10] + ids[20:]
    p, cache = store.lookup(M, other, len(other) - 1)
    assert p == 10 and all(c.offset == 10 for c in cache)
    ref = kv(prefill(model, ids[:10]), 10)
    got = kv(cache, 10)
    close(got[0], ref[0])
    close(got[1], ref[1])
    assert same(greedy(model, cache, other[10:], 3), greedy(model, make_prompt_cache(model), other, 3))


def test_limit_caps_the_prefix(tiny):
    """The decode node must run the last prompt token itself: a stored exact prompt is trimmed to the limit."""
    model, ids = tiny
    store = PrefixStore(1 << 30)
    store.store(M, ids[:12], prefill(model, ids[:12]))
    p, cache = store.lookup(M, ids[:12], 11)
    assert p == 11 and all(c.offset == 11 for c in cache)


def test_handed_out_cache_is_a_copy(tiny):
    """Generation mutates its cache (in-place slice writes after a trim); the stored entry must not change."""
    model, ids = tiny
    store = PrefixStore(1 << 30)
    stored = prefill(model, ids[:16])
    before = kv(stored, 16)
    store.store(M, ids[:16], stored)
    p, cache = store.lookup(M, ids[:10] + ids[30:], 12)
    assert p == 10 and cache[0] is not stored[0]
    model(mx.array(ids[30:36])[None], cache=cache)  # overwrites positions 10..15 of the copy's buffers
    mx.eval([c.state for c in cache])
    after = kv(stored, 16)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    p, again = store.lookup(M, ids, 16)
    assert p == 16 and np.array_equal(kv(again, 16)[0], before[0])


def test_store_keeps_only_the_tokens_the_cache_holds(tiny):
    """tokens = prompt + generated; the last sampled token may not have been fed: the cache offset decides."""
    model, ids = tiny
    store = PrefixStore(1 << 30)
    store.store(M, ids[:13], prefill(model, ids[:12]))  # 13 tokens fed "in theory", 12 in the cache
    assert store.lookup(M, ids, 13)[0] == 12
    with pytest.raises(ValueError, match="cache holds 12 tokens"):
        store.store(M, ids[:11], prefill(model, ids[:12]))


def test_byte_bound_evicts_least_recent(tiny):
    model, ids = tiny
    one = prefill(model, ids[:8])
    size = sum(c.nbytes for c in one)
    store = PrefixStore(size + size // 2)  # room for one entry of this size, not two
    store.store(M, ids[:8], one)
    store.store(M, ids[1:9], prefill(model, ids[1:9]))
    assert len(store) == 1 and store.nbytes <= size + size // 2
    assert store.lookup(M, ids, 8) == (0, None)  # the first one went
    assert store.lookup(M, ids[1:], 8)[0] == 8
    tiny = PrefixStore(size // 2)  # one entry alone is over the bound: nothing is kept
    tiny.store(M, ids[:8], prefill(model, ids[:8]))
    assert len(tiny) == 0 and tiny.nbytes == 0


def test_append_kv_after_a_prefix_equals_a_full_prefill(tiny):
    """Reused prefix [0, P) + received KV [P, T) appended = MLX's own prefill of [0, T)."""
    model, ids = tiny
    store = PrefixStore(1 << 30)
    store.store(M, ids[:9], prefill(model, ids[:9]))
    p, cache = store.lookup(M, ids, 20)
    full_k, full_v = cache_kv(prefill(model, ids[:20]), 20)
    append_kv(cache, full_k[:, :, p:], full_v[:, :, p:])
    assert p == 9 and all(c.offset == 20 for c in cache)
    close(kv(cache, 20)[0], full_k)
    assert same(greedy(model, cache, ids[20:21], 3), greedy(model, make_prompt_cache(model), ids[:21], 3))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss (sliding window 16 on every other layer): mlx-lm makes RotatingKVCache layers for it."""
    model, _ = load(str(tiny_models.build("gpt_oss", tmp_path_factory.mktemp("oss") / "gpt_oss", window=16)))
    return model


def test_sliding_window_caches_reuse_only_exact_prefixes(gpt_oss):
    model = gpt_oss
    ids = list(range(3, 40))
    wrapped = prefill(model, ids[:24])  # 24 > window 16: the rotating layers can no longer trim
    assert any(isinstance(c, RotatingKVCache) for c in wrapped) and any(type(c) is KVCache for c in wrapped)
    store = PrefixStore(1 << 30)
    store.store(M, ids[:24], wrapped)
    p, cache = store.lookup(M, ids, 30)  # the stored sequence is a prefix: reused as is
    assert p == 24
    assert same(greedy(model, cache, ids[24:31], 3), greedy(model, make_prompt_cache(model), ids[:31], 3))
    assert store.lookup(M, ids[:20] + [2], 21) == (0, None)  # would need a trim: refused
    assert store.lookup(M, ids[:24], 23) == (0, None)  # the limit would need a trim too

    young = PrefixStore(1 << 30)  # before the window fills, rotating caches trim like any other
    young.store(M, ids[:12], prefill(model, ids[:12]))
    p, cache = young.lookup(M, ids[:8] + [2, 2, 2], 10)
    assert p == 8
    assert same(greedy(model, cache, [2, 2, 2], 3), greedy(model, make_prompt_cache(model), ids[:8] + [2, 2, 2], 3))


def test_quantized_prefix_reuse_decodes_like_mlx(llama):
    """decode.kv_bits: the stored caches are mlx-lm QuantizedKVCache; appended KV is quantized as it lands, and
    greedy decode equals MLX alone generating with the same kv_bits over the whole prompt."""
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import QuantizedKVCache

    model, tok = llama
    ids = tok.encode(TEXT)
    q = {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0}
    cache = make_prompt_cache(model)
    fed = ids[:14] + [r.token for r in stream_generate(model, tok, mx.array(ids[:14]), max_tokens=3,
                                                       prompt_cache=cache, **q)]
    assert all(isinstance(c, QuantizedKVCache) for c in cache)
    store = PrefixStore(1 << 30)
    store.store(M, fed, cache)
    prompt = ids[:14] + ids[20:36]  # leaves turn 1's prompt after 14 tokens: only prompt-computed KV is reused
    p, reused = store.lookup(M, prompt, len(prompt) - 1)
    assert p == 14 and all(isinstance(c, QuantizedKVCache) and c.offset == 14 for c in reused)
    k, v = cache_kv(prefill(model, prompt[:-1]), len(prompt) - 1)  # the float KV a prefill node would send
    append_kv(reused, k[:, :, p:], v[:, :, p:])
    ours = steps(stream_generate(model, tok, mx.array(prompt[-1:]), max_tokens=8, prompt_cache=reused, **q))
    alone = steps(stream_generate(model, tok, mx.array(prompt), max_tokens=8, **q))
    assert same(ours, alone, tol=1e-2)  # 8-bit KV: a value near a rounding edge may land one step apart


def steps(responses) -> tuple[list[int], np.ndarray]:
    """mlx-lm's generation responses as (tokens, each step's log-probabilities)."""
    rs = list(responses)
    return [r.token for r in rs], np.stack([np.array(r.logprobs) for r in rs])
