"""Prometheus metrics for the gateway, one CollectorRegistry per app (so tests and apps never share counters).

Labels stay bounded: model ids from config.toml, the four paths, a status word, node names, fallback reasons.
Never request ids.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# LLM latencies run from a few ms (one decode step) to a minute (a long prompt on a busy node).
QUEUE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 180.0, 240.0, 300.0)  # up to max_wait_s's default
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# Why a request left its first-choice path; the only values disagg_fallbacks_total{reason} takes.
FALLBACK_REASONS = ("decode_node_failed", "decode_node_busy", "decode_failover", "prefill_node_failed",
                    "kv_timeout", "kv_error", "kv_aborted", "kv_fidelity", "upstream", "no_capacity")
# Why a prefill call failed (disagg_prefill_failures_total{node,kind}): unreachable (no connection), refused (an
# HTTP error answer), broken (the call dropped midway), node_down (health checks marked it down during the call),
# stalled (the node answered no prefill call for [gateway] prefill_stall_s while this one ran), kv_not_delivered (the
# node computed the prompt but its KV stream to the decode node never opened: HTTP 502 from kv_bridge/send_status.py).
PREFILL_FAILURES = ("unreachable", "refused", "broken", "node_down", "stalled", "kv_not_delivered")
AFFINITY_OUTCOMES = ("hit", "miss", "skipped")  # skipped: the remembered node was down, full or too busy

UNKNOWN_MODEL = "unknown"  # label for requests that never named a configured model
NO_PATH = "none"  # label for requests that failed before a node was chosen


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "disagg_requests", "Chat requests by model, final path and outcome", ["model", "path", "status"], registry=r
        )
        self.ttft = Histogram(
            "disagg_time_to_first_token_seconds", "Request arrival to first token", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "disagg_inter_token_latency_seconds", "Gap between successive tokens", ["model"],
            buckets=ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "disagg_e2e_request_latency_seconds", "Request arrival to last token (successful requests)", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.prefill = Histogram(
            "disagg_prefill_seconds", "Wall time of the prefill node's /v1/prefill call", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.kv_transfer = Histogram(
            "disagg_kv_transfer_seconds", "KV transfer time reported by the decode node", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.kv_bytes = Counter("disagg_kv_transfer_bytes", "KV bytes received by decode nodes", ["model"], registry=r)
        self.prefix_tokens = Counter(
            "disagg_prefix_tokens", "Prompt tokens whose KV a decode node reused from an earlier request (not moved, "
            "not recomputed)", ["model"], registry=r,
        )
        self.prompt_tokens = Counter("disagg_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("disagg_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.running = Gauge("disagg_requests_running", "Requests generating now", ["model"], registry=r)
        self.node_up = Gauge("disagg_node_up", "1 when the node's /health answers ok", ["node", "role"], registry=r)
        self.fallbacks = Counter(
            "disagg_fallbacks", "Fallback steps taken, by reason: another node, decode-local prefill, the upstream, "
            "or no capacity (429/503)", ["model", "reason"], registry=r,
        )
        self.affinity = Counter(
            "disagg_prefix_affinity", "Decode-node choices for prompts with a remembered prefix (hit, skipped) or "
            "without one (miss)", ["model", "outcome"], registry=r,
        )

        self.prefill_failures = Counter(
            "disagg_prefill_failures", "Prefill calls that failed, by node and kind (" + ", ".join(PREFILL_FAILURES)
            + "); the decode node then prefills locally", ["node", "kind"], registry=r,
        )
        self.path_choice = Counter(
            "disagg_path_choices", "Paths the cost model chose for new requests (disaggregated, local)",
            ["model", "path"], registry=r,
        )
        self.rate = Gauge(
            "disagg_learned_rate", "Rates learned from the running system: prefill (tokens/s per prefill node), "
            "local_prefill (tokens/s per decode node), link (bytes/s per prefill->decode pair)", ["kind", "node"],
            registry=r,
        )
        self.admission_tokens = Gauge(
            "disagg_admission_tokens", "Prompt tokens per prefill node, in flight in it or queued in the gateway",
            ["node", "state"], registry=r,
        )
        # The gateway's request queue (gateway/cluster/queue.py): busy models make requests wait, as Ollama does.
        self.queue_length = Gauge("disagg_queue_length", "Requests waiting in the gateway's queue for their model",
                                  ["model"], registry=r)
        self.queue_wait = Histogram(
            "disagg_queue_wait_seconds", "Time a queued request waited in the gateway's queue (whatever its outcome)",
            ["model"], buckets=QUEUE_BUCKETS, registry=r,
        )
        self.queue_refused = Counter(
            "disagg_queue_refused", "Requests given the busy answer: queue full (max_queued) or waited max_wait_s",
            ["model", "reason"], registry=r,
        )
        # The KV fidelity canary per (model, prefill, decode) pair (gateway/cluster/fidelity.py).
        # Values of disagg_kv_fidelity (docs/kv_bridge.md, "Lifecycle"): the last completed comparison that still
        # applies; an error does not move it.
        self.fidelity = Gauge("disagg_kv_fidelity", "KV fidelity of a prefill -> decode pair: 1 verified, 0.5 provisional "
                              "(verified before a restart that kept its KV identity, re-check pending), 0 failed, "
                              "-1 pending (no comparison yet, or a node changed since), -2 error (the canary could not "
                              "run and no verdict applies)", ["model", "prefill", "decode"], registry=r)
        self.fidelity_error = Gauge("disagg_kv_fidelity_error", "The canary's worst per-layer relative KV error",
                                    ["model", "prefill", "decode"], registry=r)
        self.fidelity_errors = Gauge("disagg_kv_fidelity_errors", "Canaries in a row that could not run (0 after any "
                                     "completed comparison); alert on it", ["model", "prefill", "decode"], registry=r)
        self.fidelity_age = Gauge("disagg_kv_fidelity_age_seconds", "Age of the pair's verdict (its last completed "
                                  "comparison); -1: none", ["model", "prefill", "decode"], registry=r)
        self.fidelity_usable = Gauge("disagg_kv_fidelity_usable", "1 when the pair may carry KV now (its verdict, or "
                                     "a [[fidelity.override]])", ["model", "prefill", "decode"], registry=r)
        self.fidelity_demoted = Gauge("disagg_kv_fidelity_demoted", "1 when the pair carries no KV on its verdict, "
                                      "by why: traffic (a request's KV failed the decode node's layer-0 check: held, "
                                      "then only a long canary or an operator re-promotes it) or canary (a failed "
                                      "canary)", ["model", "prefill", "decode", "by"], registry=r)
        self.fidelity_hold = Gauge("disagg_kv_fidelity_hold_seconds", "Seconds until a pair real traffic demoted may "
                                   "be verified again by a canary of the long form; 0: no hold left",
                                   ["model", "prefill", "decode"], registry=r)
        self.refreshers: list[Callable[["Metrics"], None]] = []  # gauges set from live state just before a scrape

    def declare(self, model_ids) -> None:
        """Create every bounded label combination at 0, so rate() works before the first fallback."""
        for model in model_ids:
            for reason in FALLBACK_REASONS:
                self.fallbacks.labels(model, reason)
            for outcome in AFFINITY_OUTCOMES:
                self.affinity.labels(model, outcome)
            self.queue_length.labels(model)
            for reason in ("full", "wait"):
                self.queue_refused.labels(model, reason)

    def queue_waited(self, model: str, seconds: float) -> None:
        self.queue_wait.labels(model).observe(seconds)

    def fallback(self, model: str, reason: str) -> None:
        if reason not in FALLBACK_REASONS:  # a node's unknown fallback_reason must not grow the label set
            reason = "kv_error"
        self.fallbacks.labels(model, reason).inc()

    def render(self) -> bytes:
        for refresh in self.refreshers:
            refresh(self)
        return generate_latest(self.registry)

    def request(self) -> "RequestRecord":
        return RequestRecord(self)


class RequestRecord:
    """Timings and outcome of one chat request; `finish` counts it exactly once."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        self.t0 = time.monotonic()
        self.model = UNKNOWN_MODEL
        self.path = NO_PATH
        self._running = False
        self._last_token: float | None = None
        self._finished = False

    def arrived(self, model: str) -> None:
        """The request's model is known; it may still wait in the gateway's queue (not running yet)."""
        self.model = model

    def started(self, model: str) -> None:
        self.model = model
        self._running = True
        self._m.running.labels(model).inc()

    def token(self) -> None:
        now = time.monotonic()
        if self._last_token is None:
            self._m.ttft.labels(self.model).observe(now - self.t0)
        else:
            self._m.itl.labels(self.model).observe(now - self._last_token)
        self._last_token = now

    def generation_done(self, done, prefill_s: float | None) -> None:
        """Record what the decode node's `done` line (and the prefill call) reported."""
        m, model = self._m, self.model
        m.prompt_tokens.labels(model).inc(done.prompt_tokens)
        m.generation_tokens.labels(model).inc(done.completion_tokens)
        if done.kv_tokens > 0:
            m.kv_transfer.labels(model).observe(done.kv_transfer_s)
        if done.kv_bytes > 0:
            m.kv_bytes.labels(model).inc(done.kv_bytes)
        if done.prefix_tokens > 0:
            m.prefix_tokens.labels(model).inc(done.prefix_tokens)
        if prefill_s is not None:
            m.prefill.labels(model).observe(prefill_s)

    def skip(self) -> None:
        """A reply that generated nothing (Ollama's load/unload): not a request to count; `finish` becomes a no-op."""
        self._finished = True

    def finish(self, status: str) -> None:
        if self._finished:
            return
        self._finished = True
        if self._running:
            self._m.running.labels(self.model).dec()
        if status == "ok":
            self._m.e2e.labels(self.model).observe(time.monotonic() - self.t0)
        self._m.requests.labels(self.model, self.path, status).inc()
