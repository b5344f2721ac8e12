"""Which (model, prefill node, decode node) pairs carry the right KV: the fidelity canary (kv_bridge/fidelity.py), run
when a pair becomes usable (both nodes up, and again after either was down: a restarted node may run other code)
and on demand (POST /fidelity). While `[fidelity] required`, only a verified pair takes the model's disaggregated
path; any other prefills on the decode node, so answers stay right. Seen in /health, disagg_kv_fidelity{...} and
one WARN line per failure that names the layer, the tensor and the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import aiohttp

from kv_bridge.config.settings import Settings
from kv_bridge.fidelity import Verdict, run_canary

from gateway.cluster.nodes import NodePool
from gateway.metrics import Metrics

log = logging.getLogger("gateway.cluster.fidelity")
Pair = tuple[str, str, str]  # (model, prefill node, decode node)


@dataclass
class _PairState:
    verdict: Verdict | None = None
    task: asyncio.Task | None = None
    retry_at: float = 0.0  # monotonic: an "error" verdict's next try


class Fidelity:
    """The canary's state per pair and the loop that runs it; `usable` is what routing asks."""

    def __init__(self, settings: Settings, pool: NodePool, metrics: Metrics) -> None:
        self.cfg, self.pool, self.metrics = settings.fidelity, pool, metrics
        self.pairs: dict[Pair, _PairState] = {
            (m.id, p, d): _PairState() for m in settings.models for p in m.prefill for d in m.decode}
        for pair in self.pairs:
            metrics.fidelity.labels(*pair).set(-1)

    def usable(self, model: str, prefill: str, decode: str) -> bool:
        """May this pair carry the model's KV now? Off: always; else a failed pair never, an unverified one only
        while the canary is not `required`."""
        st = self.pairs.get((model, prefill, decode))
        if not self.cfg.enabled or st is None:
            return True
        if st.verdict is not None and st.verdict.state == "failed":
            return False
        return not self.cfg.required or (st.verdict is not None and st.verdict.ok)

    def state(self, pair: Pair) -> str:
        st = self.pairs[pair]
        if not self.cfg.enabled:
            return "unchecked"
        if st.task is not None:
            return "checking"
        return "pending" if st.verdict is None else st.verdict.state

    def snapshot(self) -> list[dict]:
        """For /health: every pair, its state and figure."""
        out = []
        for pair, st in self.pairs.items():
            row = {"model": pair[0], "prefill": pair[1], "decode": pair[2], "state": self.state(pair),
                   "usable": self.usable(*pair)}
            if st.verdict is not None:
                row.update({k: v for k, v in st.verdict.to_json().items() if k not in ("layers", "state")},
                           summary=st.verdict.summary())
            out.append(row)
        return out

    def _both_up(self, pair: Pair) -> bool:
        nodes = self.pool.nodes
        return all(n in nodes and nodes[n].up for n in pair[1:])

    def tick(self, session: aiohttp.ClientSession) -> None:
        """Forget pairs whose node is down; start the canary of pairs that are up and not verified (an "error"
        verdict after `retry_s`)."""
        if not self.cfg.enabled:
            return
        now = time.monotonic()
        for pair, st in self.pairs.items():
            if not self._both_up(pair):
                if st.verdict is not None or st.task is not None:
                    self._forget(pair)
            elif st.task is None and (st.verdict is None or (st.verdict.state == "error" and now >= st.retry_at)):
                st.task = asyncio.create_task(self._check(session, pair), name=f"fidelity-{'-'.join(pair)}")

    def _forget(self, pair: Pair) -> None:
        st = self.pairs[pair]
        if st.task is not None:
            st.task.cancel()
            st.task = None
        st.verdict = None
        self.metrics.fidelity.labels(*pair).set(-1)

    async def _check(self, session: aiohttp.ClientSession, pair: Pair) -> Verdict:
        model, p, d = pair
        nodes = self.pool.nodes
        try:
            v = await run_canary(session, model, (p, nodes[p].url), (d, nodes[d].url), {}, self.cfg.timeout_s)
        finally:
            self.pairs[pair].task = None
        self._record(pair, v)
        return v

    def _record(self, pair: Pair, v: Verdict) -> None:
        st = self.pairs[pair]
        st.verdict = v
        model, p, d = pair
        g = self.metrics.fidelity.labels(*pair)
        if v.state == "error":
            st.retry_at = time.monotonic() + self.cfg.retry_s
            g.set(-1)
            log.info("KV fidelity of %s on %s -> %s not checked (again in %.0fs): %s", model, p, d, self.cfg.retry_s,
                     v.message)
            return
        g.set(1 if v.ok else 0)
        self.metrics.fidelity_error.labels(*pair).set(v.error)
        if v.ok:
            log.info("KV fidelity of %s on %s -> %s verified: worst %s layer %d rel. error %.2g (tolerance %g), "
                     "greedy %s, %.1fs", model, p, d, v.tensor, v.layer, v.error, v.tolerance, v.greedy, v.seconds)
        else:
            log.warning("KV fidelity of %s on %s -> %s FAILED: %s layer %d rel. error %.3g (tolerance %g; wire %s, KV "
                        "%s; greedy %s)%s; this pair's requests prefill on %s instead", model, p, d, v.tensor,
                        v.layer, v.error, v.tolerance, v.wire_dtype, v.kv_dtype, v.greedy,
                        f" {v.message}" if v.message else "", d)

    async def check_now(self, session: aiohttp.ClientSession, model: str | None = None) -> list[dict]:
        """On demand: the canary of every pair (of `model`) whose nodes are up, one after another (pairs share
        links and MLX threads); waits for the verdicts."""
        for pair, st in self.pairs.items():
            if (model is None or pair[0] == model) and self._both_up(pair):
                if st.task is None:  # one already running answers for this pair
                    st.task = asyncio.create_task(self._check(session, pair), name=f"fidelity-{'-'.join(pair)}")
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(st.task)
        return [row for row in self.snapshot() if model is None or row["model"] == model]

    async def run(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        """Forever: a tick every `interval_s` (the health poll's); the app cancels this on shutdown."""
        try:
            while True:
                try:
                    self.tick(session)
                except Exception:  # a bug here must not stop the checks silently
                    log.exception("fidelity tick failed")
                await asyncio.sleep(interval_s)
        finally:
            for st in self.pairs.values():
                if st.task is not None:
                    st.task.cancel()
