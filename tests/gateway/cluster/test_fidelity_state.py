"""A real-traffic demotion's hold (gateway/cluster/fidelity_state.py), its clock given: it doubles with each demotion
after a re-promotion, up to its cap; a request in flight before the demotion does not double it; a clean spell as long
as the cap starts it over; a short canary never lifts it, a long one only once it is over, an operator's at once; another
KV identity or a calibration measured after it lifts it."""

from __future__ import annotations

import time

from kv_bridge.config.fidelity import FidelityCalibration, FidelitySchedule
from gateway.cluster.fidelity_state import TrafficHold

CFG = FidelitySchedule(traffic_hold_s=600, traffic_hold_max_s=3000)
PAIR = ("m", "p0", "d0")


def test_the_hold_doubles_with_each_demotion_after_a_repromotion_up_to_its_cap():
    h = TrafficHold()
    assert h.demote(CFG, ("a", "b"), "K layer 0 position 650", now=0) == 600 and h.active and h.count == 1
    assert h.demote(CFG, ("a", "b"), "another request's", now=5) is None and h.until == 600  # in flight: no doubling
    assert h.finding == "another request's"
    assert not h.verified(PAIR, long=False, forced=False, now=700) and h.active  # a short canary: still demoted
    assert not h.verified(PAIR, long=True, forced=False, now=300) and h.active  # a long one, inside the hold
    assert h.verified(PAIR, long=True, forced=False, now=700) and not h.active and h.left(700) == 0
    assert h.demote(CFG, ("a", "b"), "again", now=800) == 1200 and h.count == 2  # failed again: twice as long
    h.verified(PAIR, long=True, forced=False, now=2100)
    assert h.demote(CFG, ("a", "b"), "again", now=2200) == 2400
    h.verified(PAIR, long=True, forced=False, now=4700)
    assert h.demote(CFG, ("a", "b"), "again", now=4800) == 3000  # the cap
    h.verified(PAIR, long=True, forced=False, now=7900)
    assert h.demote(CFG, ("a", "b"), "much later", now=7800 + 3001 + 1) == 600  # clean for the cap: starts over


def test_an_operator_or_another_identity_or_a_later_calibration_lifts_it():
    h = TrafficHold()
    h.demote(CFG, ("a", "b"), "x", now=0)
    assert h.verified(PAIR, long=False, forced=True, now=1) and not h.active and h.count == 0  # forced: at once
    h.demote(CFG, ("a", "b"), "x", now=2)
    assert not h.lifted(PAIR, ("a", "b"), None) and h.active
    assert h.lifted(PAIR, ("a", "b2"), None) and not h.active  # the Mac upgraded: its new KV is checked afresh
    h.demote(CFG, ("a", "b"), "x", now=3)
    cal = dict(model="m", prefill="p0", decode="d0", allowance=0.1, weights="4", prefill_kv="a", decode_kv="b",
               reason="r")
    old = FidelityCalibration(**cal, date="2020-01-01T00:00:00+00:00")
    assert not h.lifted(PAIR, ("a", "b"), old) and h.active
    new = FidelityCalibration(**cal, date=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() + 5)))
    assert h.lifted(PAIR, ("a", "b"), new) and not h.active
