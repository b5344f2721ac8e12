"""/metrics on both node apps: the prefill node serves vLLM's own Prometheus registry (queue, KV usage, prefix hits);
the decode node its batch, waiting generations, tokens, KV bytes held, prefix hits and local prefills.

Labels stay bounded: model ids from config.toml, a fixed set of kinds and reasons. Never request ids.
"""

from __future__ import annotations

from typing import Mapping, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _Prefixes(Protocol):
    nbytes: int


class _ModelState(Protocol):
    speculation: object  # backends.decode.speculative.control.SpecController
    batch_size: int
    cache_bytes: int
    prefixes: _Prefixes

    def queued(self) -> int: ...


class _Receiver(Protocol):
    transfers: Mapping
    inflight_bytes: int


class DecodeState(Protocol):
    """What the gauges read from the decode node's service (backends.decode.node.DecodeService), named here so this
    module need not import the service that imports it."""

    models: Mapping[str, _ModelState]
    running: int
    receiver: _Receiver

# Why a decode node computed a prompt itself: the gateway chose the local path (no KV asked for), or the transfer it
# waited for failed (the protocol's fallback reasons: kv_timeout, kv_error, kv_aborted, ...).
LOCAL_PATH = "local_path"


def prefill_metrics_route(app: web.Application) -> None:
    """GET /metrics: vLLM's registry as its own API server exports it (the process-wide one, or the multiprocess
    collector when PROMETHEUS_MULTIPROC_DIR is set)."""
    async def metrics(request: web.Request) -> web.Response:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return web.Response(body=generate_latest(get_prometheus_registry()),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/metrics", metrics)


class DecodeMetrics:
    """Counters the request path increments (event loop) and gauges read from the service at scrape time."""

    def __init__(self, svc: DecodeState) -> None:
        self.svc = svc
        r = self.registry = CollectorRegistry()
        self.tokens = Counter("disagg_decode_generation_tokens", "Tokens generated (rate(): tokens/s)", ["model"],
                              registry=r)
        self.prefix_hits = Counter("disagg_decode_prefix_hits", "Generations that reused a held prefix", ["model"],
                                   registry=r)
        self.prefix_tokens = Counter("disagg_decode_prefix_tokens", "Prompt tokens reused from held prefixes",
                                     ["model"], registry=r)
        self.local_prefills = Counter("disagg_decode_local_prefills", "Generations whose prompt this node computed "
                                      "itself, by why (local_path or the transfer's fallback reason)",
                                      ["model", "reason"], registry=r)
        self.kv_bytes_received = Counter("disagg_decode_kv_received_bytes", "KV bytes received from prefill nodes",
                                         ["model"], registry=r)
        # The real-traffic KV check (kv_bridge/mlx/traffic.py): passed | failed (prefilled locally) | error (not run)
        self.kv_checks = Counter("disagg_decode_kv_checks", "Transfers whose layer 0 was checked, by result",
                                 ["model", "result"], registry=r)
        self.kv_check_seconds = Counter("disagg_decode_kv_check_seconds", "MLX thread seconds spent on the "
                                        "real-traffic KV check", ["model"], registry=r)
        r.register(_Gauges(svc))
        # process_cpu_seconds_total, memory, open fds (Linux; none on macOS): what vLLM's registry has on the prefill
        # node
        ProcessCollector(registry=r)

    def route(self, app: web.Application) -> None:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app.router.add_get("/metrics", metrics)

    def finished(self, model: str, prefix_tokens: int, kv_tokens: int, kv_bytes: int, computed_tokens: int,
                 fallback_reason: str | None) -> None:
        """One generation's prompt settled: where its KV came from."""
        if prefix_tokens:
            self.prefix_hits.labels(model).inc()
            self.prefix_tokens.labels(model).inc(prefix_tokens)
        if kv_bytes:
            self.kv_bytes_received.labels(model).inc(kv_bytes)
        if computed_tokens > 1:  # more than the last token, which decode always runs
            self.local_prefills.labels(model, fallback_reason or LOCAL_PATH).inc()


class _Gauges:
    """Gauges read at scrape time from what the MLX threads publish (plain ints) and the receiver."""

    def __init__(self, svc: DecodeState) -> None:
        self.svc = svc

    def collect(self):
        svc = self.svc
        batch = GaugeMetricFamily("disagg_decode_batch_size", "Generations in the MLX batch", labels=["model"])
        waiting = GaugeMetricFamily("disagg_decode_generations_waiting", "Generations handed to the MLX thread and "
                                    "not yet in its batch", labels=["model"])
        kv = GaugeMetricFamily("disagg_decode_kv_bytes", "KV bytes held: the running batch's caches and the prefix "
                               "store", labels=["model", "kind"])
        for mid, m in svc.models.items():
            batch.add_metric([mid], m.batch_size)
            waiting.add_metric([mid], m.queued())
            kv.add_metric([mid, "batch"], m.cache_bytes)
            kv.add_metric([mid, "prefix"], m.prefixes.nbytes)
        yield batch
        yield waiting
        yield kv
        yield from _spec_metrics(svc.models)
        yield GaugeMetricFamily("disagg_decode_requests_running", "Requests in /v1/generate (waiting for KV, queued "
                                "or generating)", value=svc.running)
        yield GaugeMetricFamily("disagg_decode_kv_transfers", "KV transfers registered and not yet settled",
                                value=len(svc.receiver.transfers))
        yield GaugeMetricFamily("disagg_decode_kv_inflight_bytes", "In-flight KV reserved (as float32) against "
                                "kv.max_inflight_bytes", value=svc.receiver.inflight_bytes)


def _spec_metrics(models: Mapping[str, _ModelState]):
    """Speculative decoding per model (docs/speculative.md): what was drafted and kept, the controller's state, and
    the verify cost the node measured (step seconds by query rows and context depth)."""
    def family(kind, name, doc, labels=("model",)):
        return kind(name, doc, labels=list(labels))

    drafted = family(CounterMetricFamily, "disagg_decode_spec_drafted_tokens", "Tokens drafted for verification")
    accepted = family(CounterMetricFamily, "disagg_decode_spec_accepted_tokens", "Drafted tokens the target kept")
    rejections = family(CounterMetricFamily, "disagg_decode_spec_rejections", "Verify steps that ended on a refused "
                        "drafted token: alpha = accepted / (accepted + rejections)")
    steps = family(CounterMetricFamily, "disagg_decode_spec_steps", "Decode steps of the speculative path: verify "
                   "(drafted tokens checked in one forward), plain (nothing drafted), probe (a verify while off)",
                   ("model", "kind"))
    runs = family(CounterMetricFamily, "disagg_decode_spec_generations", "Generations by how they decoded: "
                  "speculative, batch (others in the batch), joined_batch (left the speculative path when another "
                  "arrived), request_off (the request asked for plain decoding), untrimmable_cache", ("model", "path"))
    k = family(GaugeMetricFamily, "disagg_decode_spec_num_draft", "Draft length of the last step (0: plain)")
    rate = family(GaugeMetricFamily, "disagg_decode_spec_acceptance", "Per-token acceptance alpha, every source "
                  "and match length pooled, discounted over recent observations")
    arm = family(GaugeMetricFamily, "disagg_decode_spec_source_acceptance", "Per-token acceptance alpha the "
                 "controller weighs, per drafting source and match-length bucket (its prior where none observed)",
                 ("model", "source", "bucket"))
    by_src = family(CounterMetricFamily, "disagg_decode_spec_source_tokens", "Per source: tokens it drafted into "
                    "verify steps (kind=drafted) and the target kept (kind=accepted)", ("model", "source", "kind"))
    secs = family(GaugeMetricFamily, "disagg_decode_spec_step_seconds", "Measured wall seconds of a decode step by "
                  "query rows (1: a pipelined plain step; k+1: a verify step), median of the recent ones",
                  ("model", "rows", "depth"))
    n = family(GaugeMetricFamily, "disagg_decode_spec_step_samples", "Steps timed in that median",
               ("model", "rows", "depth"))
    cost = family(GaugeMetricFamily, "disagg_decode_spec_verify_cost", "Measured verify cost per drafted token, "
                  "(t(k+1 rows) / t(1 row) - 1) / k, where both have enough samples (else the config's prior rules)",
                  ("model", "k", "depth"))
    draft_kv = family(CounterMetricFamily, "disagg_decode_spec_draft_kv_tokens", "Prompt tokens whose learned "
                      "drafter KV arrived from the prefill node (its head's own prefill there) and was installed")
    for mid, m in models.items():
        ctl = m.speculation
        if not ctl.enabled:
            continue
        s = ctl.stats
        draft_kv.add_metric([mid], s.draft_kv_tokens)
        drafted.add_metric([mid], s.drafted)
        accepted.add_metric([mid], s.accepted)
        rejections.add_metric([mid], s.rejected)
        steps.add_metric([mid, "verify"], s.verify_steps)
        steps.add_metric([mid, "plain"], s.plain_steps)
        steps.add_metric([mid, "probe"], s.probes)
        for path, count in list(s.requests.items()):
            runs.add_metric([mid, path], count)
        k.add_metric([mid], ctl.k)
        rate.add_metric([mid], ctl.rate)
        for source, bucket, alpha in ctl.arm_report():
            arm.add_metric([mid, source, bucket], alpha)
        for source, (_, d, a) in list(s.by_source.items()):
            by_src.add_metric([mid, source, "drafted"], d)
            by_src.add_metric([mid, source, "accepted"], a)
        for rows, depth, seconds, samples in ctl.meter.snapshot():
            secs.add_metric([mid, str(rows), depth], seconds)
            n.add_metric([mid, str(rows), depth], samples)
        for kk, depth, c in ctl.meter.costs():
            cost.add_metric([mid, str(kk), depth], c)
    yield from (drafted, accepted, rejections, steps, runs, k, rate, arm, by_src, secs, n, cost, draft_kv)

