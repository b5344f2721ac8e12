"""`disagg bench grading`: predict a class from the cost model (backends/grading/predict.py), replay it against the
running gateway (backends/grading/replay.py), print measured against predicted, and write a JSON result and a PNG timeline.
`--baseline mac-alone` replays the same class through a second gateway over the same nodes whose models have no
prefill nodes (every prompt prefilled on its Mac, Ollama's way); `--predict` runs no replay: both makespans for the
config's site at the published rates (docs/deploy.md section 9)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from kv_bridge.config.settings import Settings

from backends.grading import replay as grading
from backends.grading import cpu as grading_cpu
from backends.grading import predict as gp
from backends.grading import rates as grading_rates
from backends.grading import spec_predict
from backends.grading import timeout as grading_timeout
from backends.site.second_gateway import SecondGateway


def add_parser(sub, common) -> None:
    g = sub.add_parser("grading", parents=[common], help="replay a class of grading requests against the gateway")
    g.add_argument("--submissions", type=int, default=60, help="submissions in the class (two requests each)")
    g.add_argument("--scale", type=float, default=1.0, help="prompt lengths (6k-25k) and num_predict (2000-3500) "
                   "times this (a small site: e.g. 0.05)")
    g.add_argument("--num-predict-scale", type=float, default=None, help="num_predict times this (default: --scale)")
    g.add_argument("--concurrency", type=_concurrencies, default=None, help="requests in flight, or a list (2,4,8): "
                   "the class at each, its latencies against --app-timeout (default: the app's, one per model)")
    g.add_argument("--app-timeout", type=float, default=grading.CLIENT_TIMEOUT_S, help="the app's client timeout (s) "
                   "each request's latency is reported against (default 300)")
    g.add_argument("--models", help="analysis,feedback model ids (default: the config's [[models]] in order)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--url", help="the gateway (default: the config's [gateway] address)")
    g.add_argument("--api-key", default=os.environ.get("DISAGG_API_KEY"), help="default: $DISAGG_API_KEY, or the "
                   "first key of the config's [auth]")
    g.add_argument("--baseline", choices=("mac-alone",), help="replay the class again with every prompt prefilled on "
                   "its Mac (a second gateway over the same nodes, no prefill nodes)")
    g.add_argument("--predict", action="store_true", help="no replay: the split and Mac-alone makespans of the "
                   "config's site at the published rates, their ratio and the dominant term")
    g.add_argument("--batch-cost", type=float, default=None, help="a decode batch step's cost per extra generation, "
                   "as a share of one step (default: 0.1, a Mac's memory-bound decode; 1.0 when every node is on "
                   "loopback (`make site`), mlx-cpu's compute-bound one)")
    g.add_argument("--shared", type=float, default=None, help="every node on one machine: how many run at their "
                   "measured speed at once (default, when every node is on loopback: this machine's cores over the "
                   "CPU a busy node cost it in the calibration calls, from /proc/stat; else none)")
    g.add_argument("--calibration", type=int, default=2, help="submissions sent alone before the class to measure the "
                   "rates and how long answers run (default 2: one answer's length is a poor guide to the class's)")
    g.add_argument("--timeout", type=float, default=grading.CLIENT_TIMEOUT_S, help="client timeout per request (s)")
    g.add_argument("--json", type=Path, default=Path("grading.json"), help="the result file")
    g.add_argument("--png", type=Path, default=Path("grading.png"), help="the timeline ('' for none)")
    g.add_argument("--no-progress", action="store_true")
    g.set_defaults(func=main)


def _concurrencies(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency wants positive integers, e.g. 2 or 2,4,8; got {text!r}")
    return sorted(set(values))


def _calls_for_sim(calls: list[grading.Call], share: dict[str, float] | None = None) -> list[gp.Call]:
    """The replay's calls for the simulation: each answer `share` of its num_predict (per model; default all)."""
    share = share or {}
    return [gp.Call(c.index, c.model, c.prompt_tokens or c.target_tokens,
                    max(1, round(c.num_predict * share.get(c.model, 1.0))), c.lane) for c in calls]


def _models(settings: Settings, args) -> list[str]:
    return args.models.split(",") if args.models else [m.id for m in settings.models][:2]


def predict(settings: Settings, base: Path, args) -> dict:
    """Both makespans of the class for the config's site at the published rates, and the split's with speculative
    decoding as modelled (backends/decode/speculative/gain.py, rates.py SPEC_ALPHA and SPEC_MATCH)."""
    site = grading_rates.published_site(settings, base)
    if args.batch_cost is not None:
        site.batch_cost = args.batch_cost
    calls = grading.workload(args.submissions, _models(settings, args), args.scale, args.seed, args.concurrency,
                             getattr(args, "num_predict_scale", None))
    out = {}
    for mode in ("split", "mac-alone"):
        outcomes = gp.simulate(site, _calls_for_sim(calls), mode)
        out[mode] = gp.summary(outcomes)
        out[mode]["latency"] = grading_timeout.predicted(outcomes, getattr(args, "app_timeout", grading.CLIENT_TIMEOUT_S))
    out["ratio"] = round(out["mac-alone"]["makespan_s"] / max(out["split"]["makespan_s"], 1e-9), 2)
    roles = dict(zip(_models(settings, args), spec_predict.ROLES))
    spec = grading_rates.published_site(settings, base, speculative=True, roles=roles)  # docs/speculative.md
    spec.batch_cost = site.batch_cost
    plain, fast = gp.simulate(site, _calls_for_sim(calls), "split"), gp.simulate(spec, _calls_for_sim(calls), "split")
    out["split+speculative"] = gp.summary(fast)
    out["speculative_gain"] = round(out["split"]["makespan_s"] / max(out["split+speculative"]["makespan_s"], 1e-9), 2)
    out["lanes"] = spec_predict.lanes(plain, fast, roles)
    families = {r.id: (grading_rates._geometry(settings, base).get(r.id) or {}).get("model_type")
                for r in settings.models if r.id in roles}
    out["assumptions"] = spec_predict.assumptions(grading_rates.PUBLISHED_RATES, families, roles)
    return out


def _print_prediction(p: dict, n: int, concurrency: str) -> None:
    print(f"predicted, {n} submissions at concurrency {concurrency}:")
    for mode in ("split", "mac-alone"):
        s = p[mode]
        terms = ", ".join(f"{k} {v:.0f}" for k, v in s["terms_s"].items())
        print(f"  {mode:>9}: makespan {s['makespan_s']:.0f} s ({s['makespan_s'] / 60:.1f} min); request-seconds: "
              f"{terms}; dominant: {s['dominant']}")
    print(f"  Mac-alone / split: {p['ratio']:.2f}x")
    for mode in ("split", "mac-alone"):
        print(grading_timeout.line(p["concurrency"], p[mode]["latency"], f" {mode:>9}"))
    s = p["split+speculative"]
    terms = ", ".join(f"{k} {v:.0f}" for k, v in s["terms_s"].items())
    print(f"  split with speculative decoding (the class replay's acceptance at fitted verify costs, k <= "
          f"{spec_predict.MAX_K}): makespan {s['makespan_s']:.0f} s ({s['makespan_s'] / 60:.1f} min); request-seconds: "
          f"{terms}; split / that: {p['speculative_gain']:.2f}x")
    spec_predict.print_lanes(p)


def _gateway_url(settings: Settings) -> str:
    return settings.gateway.url()


class Calibration:
    """What submissions outside the class, each call sent alone, measured: per model the rates of the machine now
    (as the gateway reports them: decode eval_count / eval_duration; prefill prompt tokens / x-disagg-prefill-ms;
    ingest, or the Mac's own prefill on the local path, prompt tokens / the rest of the time to first token), each the
    calls' tokens over their seconds, and how much of num_predict an answer uses (`answer_share`: num_predict is only
    a cap); on one machine, its CPU seconds over the seconds the calls computed."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, list[float]]] = {}  # model -> rate -> [tokens, seconds]
        self.cpu_s = 0.0
        self.busy_s = 0.0

    def add(self, model: str, rate: str, tokens: float, seconds: float) -> None:
        if seconds > 0:
            t = self.sums.setdefault(model, {}).setdefault(rate, [0.0, 0.0])
            t[0] += tokens
            t[1] += seconds

    @property
    def rates(self) -> dict[str, dict[str, float]]:
        return {m: {k: (min(1.0, n / d) if k == "answer_share" else n / d) for k, (n, d) in r.items()}
                for m, r in self.sums.items()}

    def shared(self, one_machine: bool) -> tuple[float | None, float | None]:
        return grading_cpu.shared(self.cpu_s, self.busy_s, grading_cpu.cores()) if one_machine else (None, None)


def _calibrate(replay: grading.Replay, calls: list[grading.Call], cpu: bool) -> Calibration:
    """Submissions outside the class (their own seed: no prefix shared with the class), each call sent alone."""
    out = Calibration()
    httpx = grading.need_httpx()
    with httpx.Client(timeout=replay.timeout) as http:
        for c in calls:
            before = grading_cpu.machine_cpu_seconds() if cpu else None
            r = http.post(replay.url + "/api/generate", headers=replay.headers, json={
                "model": c.model, "prompt": c.prompt, "stream": False, **({"format": "json"} if c.json_format else {}),
                "options": {"num_predict": c.num_predict, "temperature": 0.2, "top_p": 0.9, "seed": c.seed}})
            after = grading_cpu.machine_cpu_seconds() if cpu else None
            if r.status_code != 200 or not r.json().get("eval_duration"):
                continue
            d, h = r.json(), r.headers
            out.add(c.model, "decode", max(1, d["eval_count"] - 1), d["eval_duration"] / 1e9)
            out.add(c.model, "answer_share", d["eval_count"], c.num_predict)
            prefill_s = float(h.get("x-disagg-prefill-ms", 0)) / 1000
            rest = d["prompt_eval_duration"] / 1e9 - prefill_s - float(h.get("x-disagg-queue-ms", 0)) / 1000
            if h.get("x-disagg-path") == "local":
                out.add(c.model, "local", d["prompt_eval_count"], rest)
            if h.get("x-disagg-path") == "disaggregated" and prefill_s > 0:
                out.add(c.model, "prefill", d["prompt_eval_count"], prefill_s)
                out.add(c.model, "ingest", d["prompt_eval_count"], rest)
            if before is not None and after is not None:  # the seconds the cost model counts as a node's work
                out.cpu_s += after - before
                out.busy_s += d["eval_duration"] / 1e9 + (prefill_s if prefill_s > 0 else max(0.0, rest))
    return out


def _run(replay: grading.Replay, calls: list[grading.Call], site: gp.Site, mode: str,
         share: dict[str, float], concurrency: int = 2, app_timeout: float = grading.CLIENT_TIMEOUT_S) -> dict:
    predicted = gp.summary(gp.simulate(site, _calls_for_sim(calls, share), mode), site.shared)
    print(f"{mode}: predicted makespan {predicted['makespan_s']:.1f} s (dominant: {predicted['dominant']}); "
          f"replaying {len(calls)} requests", flush=True)
    results, makespan = replay.run(calls)
    m = grading.measured(results, makespan)
    ratio = m["makespan_s"] / max(predicted["makespan_s"], 1e-9)
    # The same model given what the replay could not know before: each answer's length (num_predict is only a cap)
    # and each prompt's count as the gateway reported it.
    known = [gp.Call(c.index, c.model, r.prompt_tokens or c.prompt_tokens, r.output_tokens or c.num_predict, c.lane)
             for c, r in zip(calls, results)]
    posterior = gp.summary(gp.simulate(site, known, mode), site.shared)
    print(f"{mode}: measured {m['makespan_s']:.1f} s against predicted {predicted['makespan_s']:.1f} s "
          f"({ratio:.2f}x); latency p50 {m['latency_s']['p50']:.1f} / p95 {m['latency_s']['p95']:.1f} / max "
          f"{m['latency_s']['max']:.1f} s; tokens/s in {m['tokens_per_s']['in']:.0f}, out "
          f"{m['tokens_per_s']['out']:.1f}; predicted with the answers' lengths known {posterior['makespan_s']:.1f} s "
          f"({m['makespan_s'] / max(posterior['makespan_s'], 1e-9):.2f}x); JSON valid {m['json_valid']} "
          f"({m['cut_by_num_predict']} cut by num_predict); paths {m['paths']}; errors {m['errors']}")
    for r in results:
        what = r.error or f"{r.path:>13} on {r.node:<8} {r.prompt_tokens:>6} in {r.output_tokens:>5} out"
        print(f"  s{r.submission:02d} {r.role:<8} {r.model:<16} {r.latency:7.1f} s  queued {r.queue_s:5.1f}  {what}")
    latency = grading_timeout.measured(results, app_timeout)
    print(grading_timeout.line(concurrency, latency, f" {mode}"))
    return {"mode": mode, "predicted": predicted, "measured": m, "measured_over_predicted": round(ratio, 3),
            "latency": latency, "predicted_latency": grading_timeout.predicted(gp.simulate(
                site, _calls_for_sim(calls, share), mode), app_timeout),
            "predicted_given_lengths": posterior,
            "requests": grading.result_rows(results)}


def _rates_line(rates: dict[str, dict[str, float]]) -> str:
    return "; ".join(f"{m} " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()) for m, r in rates.items())


def _shared(args: argparse.Namespace, cal: Calibration, one_machine: bool) -> float | None:
    """--shared, else on one machine its cores over the CPU the nodes used per second of work (printed)."""
    if args.shared is not None:
        return args.shared
    shared, use = cal.shared(one_machine)
    if shared is not None:
        print(f"one machine: a busy node cost it {use:.2f} CPU-s a second ({cal.cpu_s:.1f} CPU-s over {cal.busy_s:.1f} "
              f"s of the calibration's work, /proc/stat), {grading_cpu.cores()} cores: {shared:.2f} nodes at their "
              "measured speed at once")
    elif one_machine:
        print("one machine, but its CPU seconds could not be read (no /proc/stat): the prediction assumes every node "
              "at its measured speed at once")
    return shared


def main(settings: Settings, args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the report
    base = Path(args.config).resolve().parent
    models = _models(settings, args)
    levels = args.concurrency or [len(models)]  # the app's: one per model
    if args.predict:
        runs = {}
        for c in levels:
            args.concurrency = c
            runs[c] = p = predict(settings, base, args)
            p["concurrency"] = c
            _print_prediction(p, args.submissions, f"{c}" + (" (the app's)" if c == len(models) else ""))
        within = {c: p["split"]["latency"] for c, p in runs.items()}
        print(grading_timeout.verdict(within, args.app_timeout))
        args.json.write_text(json.dumps({"predict": runs[levels[0]], "by_concurrency": runs, "submissions":
                                         args.submissions, "scale": args.scale, "config": str(args.config),
                                         "app_timeout_s": args.app_timeout,
                                         "highest_within_timeout": grading_timeout.highest_within(within)}, indent=1))
        return 0
    if len(levels) > 1:  # the replay: the class once per concurrency, each against the app's timeout
        results, status = {}, 0
        for c in levels:
            args.concurrency = [c]
            args.json = args.json.with_name(f"{args.json.stem.split('.c')[0]}.c{c}{args.json.suffix}")
            if str(args.png) not in ("", "."):
                args.png = args.png.with_name(f"{args.png.stem.split('.c')[0]}.c{c}{args.png.suffix}")
            status |= main(settings, args)
            results[c] = json.loads(args.json.read_text())["runs"][0]["latency"]
        print("\n".join(grading_timeout.line(c, r) for c, r in results.items()))
        print(grading_timeout.verdict(results, args.app_timeout))
        return status
    args.concurrency = levels[0]
    key = args.api_key or next(iter(settings.auth.client_keys()), None)
    replay = grading.Replay(args.url or _gateway_url(settings), key, not args.no_progress, args.timeout)
    calls = grading.workload(args.submissions, models, args.scale, args.seed, args.concurrency,
                             args.num_predict_scale)
    replay.count_tokens(calls)
    health = grading.need_httpx().get(replay.url + "/health", timeout=10).json()
    calibration = grading.workload(args.calibration, models, args.scale, args.seed + 1_000_003, None,
                                   args.num_predict_scale)
    one_machine = grading_cpu.one_machine(settings)  # `make site`, a test stack: every node on this machine's CPU
    cpu = one_machine and args.shared is None
    cal = _calibrate(replay, calibration, cpu)
    measured_rates = cal.rates
    share = {m: r["answer_share"] for m, r in measured_rates.items()}
    site = grading_rates.learned_site(settings, base, health, measured_rates, args.batch_cost if args.batch_cost
                                      is not None else (1.0 if one_machine else grading_rates.MAC_BATCH_COST))
    site.shared = _shared(args, cal, one_machine)
    print(f"measured by {args.calibration} submission(s) outside the class (tokens/s; the share of num_predict an "
          "answer used): "
          + _rates_line(measured_rates))
    runs = [_run(replay, calls, site, "split", share, args.concurrency, args.app_timeout)]
    if args.baseline == "mac-alone":
        with SecondGateway(args.config, args.json.with_suffix(".mac-alone-gateway.log"), mac_alone=True) as gw:
            alone = grading.Replay(gw.url, key, not args.no_progress, args.timeout)
            # the same sizes, other notebooks: the split's prompts are in the Macs' prefix caches now
            calls = grading.workload(args.submissions, models, args.scale, args.seed, args.concurrency,
                                     args.num_predict_scale, texts="mac-alone")
            alone.count_tokens(calls)
            # one submission (mlx-cpu prefills slowly), other notebooks: the split's calibration is in the prefix caches
            recal = grading.workload(1, models, args.scale, args.seed + 1_000_003, None, args.num_predict_scale,
                                     texts="mac-alone")
            local_cal = _calibrate(alone, recal, cpu)
            local = local_cal.rates
            print("Mac-alone rates measured by one submission (tokens/s): " + _rates_line(local))
            merged = {m: {**measured_rates.get(m, {}), **{k: v for k, v in local.get(m, {}).items() if k == "local"}}
                      for m in models}
            alone_site = grading_rates.learned_site(settings, base, health, merged, site.batch_cost)
            alone_site.shared = _shared(args, local_cal, one_machine)
            runs.append(_run(alone, calls, alone_site, "mac-alone", share, args.concurrency, args.app_timeout))
        ratio = runs[1]["measured"]["makespan_s"] / max(runs[0]["measured"]["makespan_s"], 1e-9)
        predicted = runs[1]["predicted"]["makespan_s"] / max(runs[0]["predicted"]["makespan_s"], 1e-9)
        print(f"Mac-alone / split, measured: {ratio:.2f}x (predicted {predicted:.2f}x)")
    result = {"submissions": args.submissions, "scale": args.scale, "concurrency": args.concurrency,
              "app_timeout_s": args.app_timeout,
              "models": models, "calibrated_rates": measured_rates, "runs": runs,
              "one_machine": {"shared": site.shared, "cpu_s": round(cal.cpu_s, 2), "busy_s": round(cal.busy_s, 2),
                              "cores": grading_cpu.cores()} if one_machine else None}
    args.json.write_text(json.dumps(result, indent=1))
    print(f"result: {args.json}")
    if str(args.png) not in ("", "."):
        from backends.grading.plot import timeline

        print(f"timeline: {timeline([(r['mode'], r['requests'], r['predicted']) for r in runs], str(args.png))}")
    return 1 if any(r["measured"]["errors"] for r in runs) else 0
