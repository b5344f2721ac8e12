"""Scheduler half of the connector (vLLM's scheduler process): which token range of which request each step sends.

It tracks per request what was already sent, so a preempted and resumed request never re-sends a token, and
it keeps the engine stepping while aborts are pending, so they reach the workers even when nothing else runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

log = logging.getLogger("vllm.disagg.connector")


@dataclass
class SendSpec:
    """One request's token range [start, end) read in this step, to go to (host, port); the stream covers
    [kv_start, total) and opens with the first step that sends (`first`)."""

    req_id: str
    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    start: int
    end: int
    total: int
    first: bool
    kv_start: int = 0


@dataclass
class DisaggConnectorMetadata(KVConnectorMetadata):
    sends: list[SendSpec] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # transfer ids of requests that ended before their KV did


@dataclass
class _ReqState:
    params: dict
    block_ids: list[int]
    total: int
    start: int = 0  # tokens below this are not sent: the decode node already holds their KV
    sent: int = 0  # tokens below this were sent (after a preemption the request recomputes them: not again)
    opened: bool = False  # a step has sent (and so opened the stream)


def transfer_params(extra_args: dict | None) -> dict | None:
    p = (extra_args or {}).get("kv_transfer_params")
    if isinstance(p, dict) and {"transfer_id", "host", "port"} <= p.keys():
        return p
    return None


def send_start(params: dict, total: int) -> int | None:
    """The first token to send, from kv_transfer_params["start"] (default 0); None unless it lies in [0, total)."""
    start = params.get("start", 0)
    return start if isinstance(start, int) and 0 <= start < total else None


class SchedulerSide:
    def __init__(self):
        self._reqs: dict[str, _ReqState] = {}
        self._aborts: list[str] = []

    def has_pending_push_work(self) -> bool:
        """Aborts still to deliver: vLLM keeps stepping (empty steps) until the workers got them."""
        return bool(self._aborts)

    def build_connector_meta(self, scheduler_output) -> DisaggConnectorMetadata:
        meta = DisaggConnectorMetadata(aborts=self._aborts)
        self._aborts = []
        so = scheduler_output
        for nr in so.scheduled_new_reqs:
            st = self._new_request(nr)
            if st is not None:
                # From kv_start even on vLLM's own prefix-cache hit (computed tokens C > 0): the block table covers
                # [0, end), so [kv_start, end) can be read whether kv_start is below or above C.
                end = min(nr.num_computed_tokens + so.num_scheduled_tokens[nr.req_id], st.total)
                self._add_send(meta, nr.req_id, st, end)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_blocks is not None:  # preempted: a new block table
                st.block_ids = list(new_blocks[0])
            elif new_blocks is not None:
                st.block_ids.extend(new_blocks[0])
            computed = cached.num_computed_tokens[i]
            if computed < st.total:  # later chunks of a chunked prefill (or a recompute); decode steps send nothing
                self._add_send(meta, rid, st, min(computed + so.num_scheduled_tokens[rid], st.total))
        return meta

    def _new_request(self, nr) -> _ReqState | None:
        st = self._reqs.get(nr.req_id)
        if st is not None:  # a preempted request scheduled anew: its new block table, what it sent stays sent
            st.block_ids = list(nr.block_ids[0])
            return st
        params = transfer_params(nr.sampling_params.extra_args if nr.sampling_params else None)
        if params is None:
            return None
        total = len(nr.prompt_token_ids or ())
        start = send_start(params, total)
        if start is None:  # the prefill node validates kv_start; never take the scheduler down over it
            log.error("request %s: kv_transfer_params start %r outside [0, %d); not streaming its KV", nr.req_id,
                      params.get("start"), total)
            return None
        st = _ReqState(params, list(nr.block_ids[0]), total, start, sent=start)
        self._reqs[nr.req_id] = st
        return st

    def _add_send(self, meta: DisaggConnectorMetadata, rid: str, st: _ReqState, end: int) -> None:
        """Send [sent, end) unless it is empty (all below kv_start, or sent before a preemption); the first send
        opens the stream. Every token up to `end` is in the cache once this step's layer is computed."""
        if st.sent >= end:
            return
        p = st.params
        meta.sends.append(SendSpec(rid, str(p["transfer_id"]), str(p["host"]), int(p["port"]), list(st.block_ids),
                                   st.sent, end, st.total, not st.opened, st.start))
        st.opened, st.sent = True, end

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.sent < st.total:
            self._aborts.append(str(st.params["transfer_id"]))
        # The gather of every send ran on the compute stream during its step (extract.py): the blocks are read
        # before any later kernel can write them, so they can be freed now.
        return False, None
