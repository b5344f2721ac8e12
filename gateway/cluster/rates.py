"""Rates learned from the running system (per prefill node, per prefill->decode link, per decode node's local
prefill), configured values as priors, and the cost model that predicts each path's time to first token."""

from __future__ import annotations

from dataclasses import dataclass

from kv_bridge.config.gateway import RatesConfig

DISAGGREGATED = "disaggregated"
LOCAL = "local"
# Prior of a decode node's KV ingest (received KV -> its cache, then the last prompt token and the first sample), in
# prompt tokens/s; learned per (decode node, model). mlx-cpu here takes ~0.9 s for 3.7k tokens of SmolLM2 (~4k/s).
INGEST_TOKENS_PER_S = 20000.0


class Rate:
    """A smoothed rate (units/s): exponentially decayed sums of units and seconds, their ratio the estimate.

    Weighing by seconds, not by sample, keeps tiny overhead-bound samples (a 3-token prefill) from swinging it;
    the prior enters as `prior_weight_s` seconds of work observed at the prior rate and decays like any sample.
    """

    def __init__(self, prior: float, smoothing: float, prior_weight_s: float) -> None:
        if prior <= 0:
            raise ValueError(f"a rate prior must be positive, got {prior}")
        self.prior = prior
        self.keep = 1.0 - smoothing
        self.units = prior * prior_weight_s
        self.seconds = prior_weight_s
        self.samples = 0

    def observe(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:  # nothing moved, or a clock that did not advance: no information
            return
        self.units = self.keep * self.units + units
        self.seconds = self.keep * self.seconds + seconds
        self.samples += 1

    @property
    def value(self) -> float:
        return self.units / self.seconds if self.seconds > 0 else self.prior

    def snapshot(self) -> dict:
        return {"value": round(self.value, 3), "prior": self.prior, "samples": self.samples}


@dataclass(frozen=True)
class PathCosts:
    """Predicted seconds to first token of each path; `disaggregated` is None where no prefill node can take it.

    `stall` is what the local path costs the decode node's other generations, in seconds summed over them: a local
    prefill runs on the node's MLX thread between its batch's steps, so every generation decoding there meanwhile
    waits as long as it runs. The local path wins only when its own gain outweighs that.
    """

    disaggregated: float | None
    local: float
    stall: float = 0.0

    @property
    def best(self) -> str:
        if self.disaggregated is not None and self.disaggregated <= self.local + self.stall:
            return DISAGGREGATED
        return LOCAL


class Rates:
    """Every rate the router needs, keyed by node name (links by (prefill, decode)); created on first use."""

    def __init__(self, cfg: RatesConfig | None = None) -> None:
        self.cfg = cfg or RatesConfig()
        self.prefill: dict[str, Rate] = {}
        self.local: dict[str, Rate] = {}
        self.link: dict[tuple[str, str], Rate] = {}
        self.ingest: dict[str, Rate] = {}  # per "decode node/model": KV in -> first token, prompt tokens/s
        self.kv_bytes_per_token: dict[str, float] = {}  # per model, learned from transfers (0 until the first)
        self._busy_until: dict[str, float] = {}  # per prefill node: when its last call answered

    def _rate(self, table: dict, key, default_prior: float, node: str | None = None) -> Rate:
        rate = table.get(key)
        if rate is None:
            prior = self.cfg.node_priors.get(node, default_prior) if node else default_prior
            rate = table[key] = Rate(prior, self.cfg.smoothing, self.cfg.prior_weight_s)
        return rate

    def prefill_rate(self, node: str) -> Rate:
        return self._rate(self.prefill, node, self.cfg.prefill_tokens_per_s, node)

    def local_rate(self, node: str, model: str | None = None) -> Rate:
        # Per model too: a decode node serving two models prefills each at its own speed (a tiny model's fast local
        # prefills must not price a large one's).
        key = node if model is None else f"{node}/{model}"
        return self._rate(self.local, key, self.cfg.local_prefill_tokens_per_s, node)

    def link_rate(self, prefill: str, decode: str) -> Rate:
        return self._rate(self.link, (prefill, decode), self.cfg.link_bytes_per_s)

    def ingest_rate(self, decode: str, model: str | None = None) -> Rate:
        return self._rate(self.ingest, decode if model is None else f"{decode}/{model}", INGEST_TOKENS_PER_S)

    def observe_prefill(self, node: str, tokens: int, seconds: float) -> None:
        """A prefill node computed `tokens` prompt tokens in `seconds` of its own work (taken -> last frame)."""
        self.prefill_rate(node).observe(tokens, seconds)

    def prefill_call_done(self, node: str, tokens: int, started: float, now: float) -> None:
        """A prefill call of `tokens` ran from `started` to `now` (monotonic). Calls overlap on a node, so each counts
        only the time since the node's previous call answered: over a busy period the sum is the node's busy time, and
        the rate its throughput, not one call's share of it."""
        since = max(started, self._busy_until.get(node, started))
        self._busy_until[node] = max(now, self._busy_until.get(node, now))
        self.observe_prefill(node, tokens, now - since)

    def last_answer(self, node: str) -> float | None:
        """When (monotonic) `node`'s last prefill call answered 200, or None before the first."""
        return self._busy_until.get(node)

    def observe_kv_size(self, model: str, tokens: int, nbytes: int) -> None:
        if tokens > 0 and nbytes > 0:
            self.kv_bytes_per_token[model] = nbytes / tokens

    def observe_local(self, node: str, tokens: int, seconds: float, model: str | None = None) -> None:
        """A decode node prefilled `tokens` of `model` itself in `seconds`."""
        self.local_rate(node, model).observe(tokens, seconds)

    def observe_link(self, prefill: str, decode: str, nbytes: int, seconds: float) -> None:
        """`nbytes` of KV went from `prefill` to `decode` in `seconds` of link time: the decode node's time mid-frame
        (`kv_link_s`), not HEADER -> last frame, which is mostly the prefill computing the layers between frames."""
        self.link_rate(prefill, decode).observe(nbytes, seconds)

    def observe_ingest(self, decode: str, tokens: int, seconds: float, model: str | None = None) -> None:
        """The decode node gave its first token `seconds` after the last of `tokens` tokens' KV could have arrived
        (the prefill call answered, or the link carried the bytes, whichever was later)."""
        self.ingest_rate(decode, model).observe(tokens, seconds)

    def snapshot(self) -> dict:
        """For /health and metrics: every learned rate with its prior and sample count."""
        return {
            "prefill_tokens_per_s": {k: r.snapshot() for k, r in self.prefill.items()},
            "local_prefill_tokens_per_s": {k: r.snapshot() for k, r in self.local.items()},
            "link_bytes_per_s": {f"{p}->{d}": r.snapshot() for (p, d), r in self.link.items()},
            "ingest_tokens_per_s": {k: r.snapshot() for k, r in self.ingest.items()},
            "kv_bytes_per_token": {m: round(b, 1) for m, b in self.kv_bytes_per_token.items()},
        }

    def disaggregated_ttft(self, prefill: str, decode: str, prompt_tokens: int, tokens_ahead: int,
                           kv_bytes_per_token: int, model: str | None = None) -> float:
        """The prefill node's queue at its rate; then this prompt's prefill and its transfer, which run together
        (KV streams layer by layer while later layers compute), so the slower of the two; then the decode node's
        ingest of the KV and its first step. On `make site` the KV lands ~0.1 s before the prefill call answers and
        the first token ~0.9 s after (3.7k tokens): adding the transfer whole and no ingest missed both."""
        rate = self.prefill_rate(prefill).value
        compute = prompt_tokens / rate
        transfer = prompt_tokens * kv_bytes_per_token / self.link_rate(prefill, decode).value
        ingest = prompt_tokens / self.ingest_rate(decode, model).value
        return tokens_ahead / rate + max(compute, transfer) + ingest

    def local_ttft(self, decode: str, prompt_tokens: int, batch_tokens: int = 0, model: str | None = None) -> float:
        """Prefilling on the decode node: this prompt plus the prompt tokens already in its batch, at its rate."""
        return (batch_tokens + prompt_tokens) / self.local_rate(decode, model).value

    def local_stall(self, prefill: str | None, decode: str, prompt_tokens: int, *, others: int = 0,
                    arriving: int = 0, tokens_ahead: int = 0, model: str | None = None) -> float:
        """Seconds a local prefill of this prompt adds to the decode node's other generations, summed.

        It runs for T = prompt tokens / the local rate. The `others` already on the node (decoding, or with KV on the
        way) each wait all of T. The `arriving` ones (bound for the node, still queued for a prefill node's admission)
        wait only if their KV lands within T: the share of the prefill queue that the node clears in T, each of them
        T/2 on average.
        """
        t = prompt_tokens / self.local_rate(decode, model).value
        share = 1.0
        if prefill is not None and tokens_ahead > 0:
            share = min(1.0, t * self.prefill_rate(prefill).value / tokens_ahead)
        return t * (others + arriving * share / 2)

    def costs(self, prefill: str | None, decode: str, prompt_tokens: int, *, tokens_ahead: int = 0,
              batch_tokens: int = 0, others: int = 0, arriving: int = 0, kv_bytes_per_token: int = 0,
              model: str | None = None) -> PathCosts:
        disagg = None if prefill is None else self.disaggregated_ttft(
            prefill, decode, prompt_tokens, tokens_ahead, kv_bytes_per_token, model)
        stall = self.local_stall(prefill, decode, prompt_tokens, others=others, arriving=arriving,
                                 tokens_ahead=tokens_ahead, model=model)
        return PathCosts(disagg, self.local_ttft(decode, prompt_tokens, batch_tokens, model), stall)


def choose_path(costs: PathCosts, kv_tokens: int, min_disagg_tokens: int) -> str:
    """`min_disagg_tokens` stays a floor (below it local prefill, whatever the rates); above it the cheaper path."""
    if kv_tokens < min_disagg_tokens:
        return LOCAL
    return costs.best
