"""The cost model of a grading replay (`disagg bench grading`): an event simulation of the class over the config's
nodes. Each request waits in the gateway's queue (its model's max_inflight, a decode node's KV room), prefills on its
model's prefill node (first come first served, the KV streaming alongside: the slower of the two) or on the Mac itself
(the local path: the Mac's decode steps stop meanwhile), then decodes on the least-loaded Mac, which shares its steps
between the models it runs (one step of each model's batch in turn, a batch step costing 1 + batch_cost x (b - 1)
single steps). Rates come from the gateway's learned ones (`make site`) or the published ones (docs/deploy.md sec. 9).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

TERMS = ("queue", "prefill", "transfer", "decode")


@dataclass(frozen=True)
class ModelRates:
    """One model's rates. Prefill and decode rates are (prompt depth, tokens/s) points, interpolated linearly."""

    prefill: tuple[tuple[int, float], ...]          # the prefill node's prompt tokens/s at a depth
    local_prefill: tuple[tuple[int, float], ...]    # the Mac's own prompt tokens/s (the local path)
    decode: tuple[tuple[int, float], ...]           # one generation's tokens/s on a Mac at a context length
    kv_wire_bytes: float = 0.0                      # per prompt token on the wire
    kv_hold_bytes: float = 0.0                      # per prompt token reserved on the Mac (model dtype)
    ingest_tokens_per_s: float = 20000.0            # KV in -> first token on the Mac
    # speculative decoding's decode speedup at a context length, while the generation is its model's only one on
    # the Mac (a batch of two or more decodes plainly: docs/speculative.md); 1: off
    spec_speedup: tuple[tuple[int, float], ...] = ((0, 1.0),)


@dataclass(frozen=True)
class Route:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    max_inflight: int | None = None
    min_disagg_tokens: int = 0


@dataclass
class Site:
    routes: dict[str, Route]
    rates: dict[str, ModelRates]
    link_bytes_per_s: float = 1.1e9
    kv_capacity_bytes: float = float("inf")         # per Mac: kv.max_inflight_bytes
    max_batch: int = 8                              # per Mac and model: [decode] max_batch_size
    batch_cost: float = 0.1
    shared: float | None = None                     # one machine runs every node: how many at full speed at once


@dataclass
class Call:
    """One request of the replay: `lane` is the client worker that sends it (its calls go in order)."""

    index: int
    model: str
    prompt_tokens: int
    max_tokens: int
    lane: int


@dataclass
class Outcome:
    index: int
    model: str
    node: str = ""
    prefill_node: str = ""   # where the prompt was computed: a prefill node, or the Mac itself (the local path)
    path: str = ""
    sent: float = 0.0
    admitted: float = 0.0
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    decode_start: float = 0.0
    end: float = 0.0
    terms: dict = field(default_factory=dict)


def interp(points: tuple[tuple[int, float], ...], x: float) -> float:
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def prefill_seconds(points: tuple[tuple[int, float], ...], tokens: int, step: int = 256) -> float:
    """Seconds to prefill `tokens` at a rate that depends on the depth reached (each chunk at its depth's rate)."""
    t, done = 0.0, 0
    while done < tokens:
        n = min(step, tokens - done)
        t += n / interp(points, done + n / 2)
        done += n
    return t


class _Mac:
    def __init__(self, name: str, batch_cost: float) -> None:
        self.name, self.batch_cost = name, batch_cost
        self.gens: list[list] = []  # [outcome, model, tokens left, decode rate, KV held, speculative speedup]
        self.held = 0.0             # KV bytes reserved
        self.local_until = 0.0      # the end of the local prefill running (decode paused until then)
        self.count = 0              # generations placed here, decoding or about to

    def step_time(self) -> float:
        """One round: a step of each model's batch."""
        by_model: dict[str, list[float]] = {}
        for g in self.gens:
            by_model.setdefault(g[1], []).append(g[3])
        alone = {g[1]: g[5] for g in self.gens if len(by_model[g[1]]) == 1}  # speculates: the batch's only one
        return sum(len(r) / sum(r) * (1 + self.batch_cost * (len(r) - 1)) / alone.get(m, 1.0)
                   for m, r in by_model.items())


def simulate(site: Site, calls: list[Call], mode: str = "split") -> list[Outcome]:
    """Each call's outcome when lanes send their calls in order; `mode` "mac-alone": every prompt prefilled on its
    Mac."""
    macs = {n: _Mac(n, site.batch_cost) for r in site.routes.values() for n in r.decode}
    prefill_free: dict[str, float] = {}
    lanes: dict[int, list[Call]] = {}
    for c in calls:
        lanes.setdefault(c.lane, []).append(c)
    for q in lanes.values():
        q.reverse()
    out: dict[int, Outcome] = {}
    waiting: dict[str, list[Call]] = {}
    inflight: dict[str, int] = {}
    events: list = []  # (time, seq, kind, payload)
    seq = 0
    now = 0.0

    def push(t: float, kind: str, payload) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    def send(lane: int) -> None:
        if lanes[lane]:
            c = lanes[lane].pop()
            out[c.index] = Outcome(c.index, c.model, sent=now)
            waiting.setdefault(c.model, []).append(c)

    def place(c: Call) -> bool:
        route, rates = site.routes[c.model], site.rates[c.model]
        if route.max_inflight is not None and inflight.get(c.model, 0) >= route.max_inflight:
            return False
        need = rates.kv_hold_bytes * c.prompt_tokens
        fits = [m for m in (macs[n] for n in route.decode) if m.held + need <= site.kv_capacity_bytes
                and sum(g[1] == c.model for g in m.gens) < site.max_batch]
        if not fits:
            return False
        mac = min(fits, key=lambda m: m.count)
        o = out[c.index]
        o.admitted, o.node = now, mac.name
        inflight[c.model] = inflight.get(c.model, 0) + 1
        mac.held += need
        mac.count += 1
        local = mode == "mac-alone" or not route.prefill or c.prompt_tokens < route.min_disagg_tokens
        if local:
            o.path, o.prefill_node = "local", mac.name
            start = max(now, mac.local_until)
            dur = prefill_seconds(rates.local_prefill, c.prompt_tokens)
            mac.local_until = start + dur
            o.prefill_start, o.prefill_end, ready = start, start + dur, start + dur
            o.terms = {"queue": start - o.sent, "prefill": dur, "transfer": 0.0}
        else:
            node = min(route.prefill, key=lambda n: prefill_free.get(n, 0.0))
            o.path, o.prefill_node = "disaggregated", node
            start = max(now, prefill_free.get(node, 0.0))
            compute = prefill_seconds(rates.prefill, c.prompt_tokens)
            transfer = c.prompt_tokens * rates.kv_wire_bytes / site.link_bytes_per_s
            prefill_free[node] = start + max(compute, transfer)
            ingest = c.prompt_tokens / rates.ingest_tokens_per_s
            o.prefill_start, o.prefill_end = start, start + compute
            ready = start + max(compute, transfer) + ingest
            o.terms = {"queue": start - o.sent, "prefill": compute, "transfer": max(0.0, transfer - compute) + ingest}
        push(ready, "decode", (c, mac, need))
        return True

    def admit() -> None:
        # first come first served per model; models take turns (each model's head tries, in model order)
        progress = True
        while progress:
            progress = False
            for model in list(waiting):
                if waiting[model] and place(waiting[model][0]):
                    waiting[model].pop(0)
                    progress = True

    for lane in lanes:
        send(lane)
    admit()
    while events or any(m.gens for m in macs.values()):
        # the next decode completion at the current rates
        best, best_t = None, float("inf")
        for mac in macs.values():
            if not mac.gens or mac.local_until > now:
                continue
            t_round = mac.step_time()
            for g in mac.gens:
                t = now + g[2] * t_round
                if t < best_t:
                    best, best_t = (mac, g), t
        t_event = events[0][0] if events else float("inf")
        t_next = min(best_t, t_event)
        paused_until = [m.local_until for m in macs.values() if m.gens and now < m.local_until < t_next]
        if paused_until:
            t_next = min(paused_until)
            best = None
        for mac in macs.values():
            if mac.gens and mac.local_until <= now:
                t_round = mac.step_time()
                for g in mac.gens:
                    g[2] -= (t_next - now) / t_round
        now = t_next
        if best is not None and best_t <= t_event and best_t == t_next:
            mac, g = best
            _finish(mac, g, now, site, out, inflight)
            for mac2 in macs.values():  # others that end at the same instant
                for g2 in [g2 for g2 in mac2.gens if g2[2] <= 1e-9]:
                    _finish(mac2, g2, now, site, out, inflight)
            _refill(out, lanes, calls, now, send)
            admit()
            continue
        while events and events[0][0] <= now:
            _, _, kind, (c, mac, need) = heapq.heappop(events)
            o = out[c.index]
            o.decode_start = now
            rate = interp(site.rates[c.model].decode, c.prompt_tokens)
            spec = interp(site.rates[c.model].spec_speedup, c.prompt_tokens)
            mac.gens.append([o, c.model, float(c.max_tokens), rate, need, spec])
    return [out[c.index] for c in calls]


def _finish(mac: _Mac, g: list, now: float, site: Site, out: dict, inflight: dict) -> None:
    o = g[0]
    mac.gens.remove(g)
    mac.held -= g[4]
    mac.count -= 1
    inflight[g[1]] -= 1
    o.end = now
    o.terms["decode"] = now - o.decode_start


def _refill(out: dict, lanes: dict, calls: list[Call], now: float, send) -> None:
    """Every lane whose last call ended sends its next one."""
    busy = {c.lane for c in calls if c.index in out and out[c.index].end == 0.0}
    for lane in lanes:
        if lane not in busy:
            send(lane)


def node_intervals(outcomes: list[Outcome]) -> dict[str, list[tuple[float, float]]]:
    """Each node's busy time as disjoint intervals: its prefills (a prefill node's, or a Mac's own on the local path)
    and a Mac's decoding (the union of its generations' decode spans)."""
    raw: dict[str, list[tuple[float, float]]] = {}
    for o in outcomes:
        if o.prefill_end > o.prefill_start:
            raw.setdefault(o.prefill_node or o.node, []).append((o.prefill_start, o.prefill_end))
        if o.end > o.decode_start:
            raw.setdefault(o.node, []).append((o.decode_start, o.end))
    out = {}
    for node, intervals in raw.items():
        merged: list[list[float]] = []
        for a, b in sorted(intervals):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out[node] = [(a, b) for a, b in merged]
    return out


def busy_seconds(outcomes: list[Outcome]) -> float:
    """The work of the class in seconds of a node at its measured speed."""
    return sum(b - a for intervals in node_intervals(outcomes).values() for a, b in intervals)


def shared_makespan(outcomes: list[Outcome], shared: float) -> float:
    """The makespan when one machine runs every node and gives `shared` of them their measured speed at once:
    processor sharing, each stretch of the timeline where n nodes are busy taking max(1, n / shared) times as long."""
    edges = sorted((t, d) for intervals in node_intervals(outcomes).values() for a, b in intervals
                   for t, d in ((a, 1), (b, -1)))
    total, busy, last = 0.0, 0, 0.0
    for t, d in edges:
        total += (t - last) * max(1.0, busy / shared)
        busy, last = busy + d, t
    return total + max(0.0, max((o.end for o in outcomes), default=0.0) - last)


def summary(outcomes: list[Outcome], shared: float | None = None) -> dict:
    """Makespan, the seconds each term took summed over requests, and the dominant one. `shared`: every node runs on
    one machine that gives this many of them their measured speed at once (`make site`: its roles share the CPU);
    where more are busy, the timeline stretches (`shared_makespan`), and past a stretch of a tenth the dominant
    term is "machine"."""
    terms = {t: round(sum(o.terms.get(t, 0.0) for o in outcomes), 3) for t in TERMS}
    makespan = max((o.end for o in outcomes), default=0.0)
    out = {"makespan_s": round(makespan, 3), "terms_s": terms,
           "dominant": max(terms, key=terms.get) if outcomes else None}
    if shared:
        stretched = shared_makespan(outcomes, shared)
        out["machine_bound_s"] = round(busy_seconds(outcomes) / shared, 3)
        out["unshared_makespan_s"] = out["makespan_s"]
        out["makespan_s"] = round(stretched, 3)
        if stretched > 1.1 * makespan:
            out["dominant"] = "machine"
    return out
