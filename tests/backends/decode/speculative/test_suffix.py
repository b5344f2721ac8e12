"""Suffix decoding (backends/decode/speculative/suffix.py): longest-suffix matching, SuffixDecoding's frequency
scoring, the store's token bound and age eviction, incremental indexing, an empty store."""

import random

import pytest

from backends.decode.speculative.suffix import END, SuffixDrafter, SuffixIndex, SuffixStore


def test_drafts_the_continuation_of_the_longest_match_in_the_prompt():
    seq = [1, 2, 3, 4, 5, 6, 7, 9, 9, 3, 4, 5]
    d = SuffixDrafter(seq)
    while d.prefill_step():
        pass
    assert d.draft(3) == [6, 7, 9]
    assert d.match_len == 3 and d.source == "prompt"


def test_nothing_to_match_drafts_nothing():
    d = SuffixDrafter([1, 2, 3, 4], SuffixStore())
    assert d.draft(3) == [] and d.match_len == 0 and d.source == ""
    assert d.draft(0) == []


def test_a_short_match_drafts_at_most_its_length():
    # max_spec_factor 1 (vLLM's default): a match of one token proposes one token
    seq = [5, 8, 1, 2, 3, 8]
    assert SuffixDrafter(seq).draft(3) == [1]


def test_the_more_frequent_continuation_wins_and_probabilities_multiply():
    # after [7, 8]: 9 followed three times, 4 once; after [7, 8, 9]: 1 twice, 2 once. After the longer match
    # [0, 7, 8]: 9 twice, 4 once, then 1 and 2 once each: a lower score (4/3) than [7, 8]'s (7/4)
    seq = [7, 8, 9, 1, 0, 7, 8, 9, 1, 0, 7, 8, 9, 2, 0, 7, 8, 4, 0, 7, 8]
    idx = SuffixIndex(list(seq))
    idx.catch_up()
    d = idx.lookup(seq, 3, min_prob=0.1, factor=10)
    assert d.tokens == [9, 1, 0] and d.match_len == 2
    assert d.score == pytest.approx(3 / 4 + 3 / 4 * 2 / 3 + 3 / 4 * 2 / 3 * 1.0)
    # a threshold above the second token's path probability (0.5) stops after the first
    assert idx.lookup(seq, 3, min_prob=0.6, factor=10).tokens == [9]
    # max_spec_factor 1: a match of 2 drafts at most 2 tokens (score 5/4), so the match of 3 wins (4/3)
    d = idx.lookup(seq, 3, min_prob=0.1)
    assert d.tokens == [9, 2, 0] and d.match_len == 3 and d.score == pytest.approx(4 / 3)


def test_the_most_recent_occurrence_breaks_a_tie():
    seq = [3, 4, 1, 3, 4, 2, 3, 4]
    assert SuffixDrafter(seq).draft(1) == [2]


def test_the_store_drafts_from_earlier_answers_and_prefers_a_better_score():
    store = SuffixStore()
    for _ in range(3):
        store.add([100, 101, 102, 103, 104, 105])
    seq = [1, 100, 101, 102]
    d = SuffixDrafter(seq, store)
    assert d.draft(3) == [103, 104, 105]
    assert d.source == "store" and d.match_len == 3
    assert SuffixDrafter(list(seq)).draft(3) == []  # the prompt alone has nothing


def test_no_continuation_crosses_from_one_answer_into_the_next():
    store = SuffixStore()
    store.add([10, 11, 12])
    store.add([13, 14])
    assert store.lookup([11, 12], 3).tokens == []
    assert END not in store.index.lookup([10, 11], 3).tokens


def test_finish_stores_only_the_answer_once():
    store = SuffixStore()
    seq = [1, 2, 3]
    d = SuffixDrafter(seq, store)
    seq += [40, 41, 42]
    d.finish()
    d.finish()
    assert store.answers == 1 and store.tokens == 4  # three tokens and the separator
    assert store.lookup([40, 41], 3).tokens == [42]


def test_store_memory_is_bounded_and_the_oldest_answers_go_first():
    store = SuffixStore(max_tokens=20)
    store.add([1, 2, 3, 4, 5, 6, 7, 8, 9])      # 10 with its separator
    store.add([21, 22, 23, 24, 25, 26, 27, 28, 29])
    assert store.lookup([1, 2], 3).tokens == [3, 4]
    store.add([31, 32, 33])                     # 24 > 20: the first answer goes
    assert store.tokens <= 20 and store.answers == 2
    assert store.lookup([1, 2], 3).tokens == []
    assert store.lookup([21, 22], 3).tokens == [23, 24]
    for i in range(50):  # many evictions: the index is rebuilt, never larger than twice the live tokens
        store.add([100 + i, 200 + i, 300 + i])
    live = len(store.index.tokens)
    held = sum(len(v) for m in store.index.maps.values() for v in m.values())
    assert store.tokens <= 20 and held <= 2 * live * len(store.index.anchors)
    assert store.lookup([149, 249], 1).tokens == [349]


def test_an_answer_longer_than_the_store_keeps_its_tail():
    store = SuffixStore(max_tokens=5)
    store.add(list(range(10)))
    assert store.tokens == 5 and store.lookup([7, 8], 1).tokens == [9]


def test_indexing_is_incremental_one_entry_per_anchor_per_token():
    rng = random.Random(0)
    seq = [rng.randrange(50) for _ in range(25_000)]
    d = SuffixDrafter(seq, anchors=(1, 3, 8))
    steps = 0
    while d.prefill_step():
        steps += 1
    assert steps == 6  # 24,999 positions: six chunks of 4,096 say more remain, the seventh ends
    entries = sum(len(v) for m in d.own.maps.values() for v in m.values())
    assert d.own.indexed == len(seq) - 1
    for _ in range(100):
        d.draft(3)
        seq.append(rng.randrange(50))
        d.draft(3)
        after = sum(len(v) for m in d.own.maps.values() for v in m.values())
        assert after - entries == 3  # the one new position, once per anchor: nothing re-indexed
        entries = after


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixStore(max_tokens=1)
    with pytest.raises(ValueError, match="anchors"):
        SuffixIndex(anchors=(0,))
    with pytest.raises(ValueError, match="depth"):
        SuffixDrafter([1], depth=0)
