"""The canary's rounds per (model, prefill node): the long start canary first, then whole and prefix rounds in turn,
each whole round with a fresh nonce and each prefix round on the text of the round before it (the prefill node's
prefix cache serves its start); a configured prefix pins the prefix path; pairs keep their own count."""

from __future__ import annotations

from backends.decode.canary_plan import CanaryPlan


def test_rounds_alternate_after_one_long_canary_and_prefix_rounds_reuse_the_text():
    plan = CanaryPlan()
    r = [plan.next("m", "p0", 136, 2304, 0) for _ in range(5)]
    assert [x.tokens for x in r] == [2304, 136, 136, 136, 136]
    assert [x.prefix for x in r] == [0, 68, 0, 68, 0]
    assert r[1].nonce == r[0].nonce and r[3].nonce == r[2].nonce  # a prefix round: the previous text, cached
    assert len({r[0].nonce, r[2].nonce, r[4].nonce}) == 3  # a whole round: a text no cache has seen
    other = plan.next("m", "p1", 136, 2304, 0)  # another prefill node starts its own rounds
    assert (other.tokens, other.prefix) == (2304, 0) and other.nonce not in {x.nonce for x in r}


def test_a_configured_prefix_pins_the_prefix_path_and_no_start_canary_keeps_the_length():
    plan = CanaryPlan()
    r = [plan.next("m", "p0", 136, 0, 64) for _ in range(3)]
    assert [(x.tokens, x.prefix) for x in r] == [(136, 64)] * 3


def test_the_long_form_on_request_whatever_the_round_and_only_where_it_is_longer():
    plan = CanaryPlan()
    r = [plan.next("m", "p0", 136, 2304, 0, long=x) for x in (False, False, True, False)]
    assert [(x.tokens, x.prefix, x.long) for x in r] == [(2304, 0, True), (136, 68, False), (2304, 0, True),
                                                         (136, 68, False)]
    assert r[2].nonce != r[1].nonce  # the long form never rides on a cached text
    assert not CanaryPlan().next("m", "p0", 136, 0, 0, long=True).long  # no long canary configured: none
