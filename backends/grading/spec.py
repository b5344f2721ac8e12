"""`disagg bench spec --config F --model M`: the site measures its own speculative decoding. Grading-like prompts (the
class replay's: JSON analysis and prose-asking feedback over a student's notebook) sent through the running gateway,
each twice, speculation off (x-disagg-speculative: off) and on, alternating; decode tokens/s from Ollama's
eval_count / eval_duration, and alpha, k and the measured verify cost from the model's decode nodes' /metrics."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from kv_bridge.config.settings import Settings
from kv_bridge.protocol import SPECULATIVE_HEADER

from backends.grading import replay as grading

# Counters read from each decode node before and after a request: their deltas are that request's (one at a time)
COUNTERS = {"drafted": "disagg_decode_spec_drafted_tokens_total", "accepted": "disagg_decode_spec_accepted_tokens_total",
            "rejections": "disagg_decode_spec_rejections_total"}
STEPS = "disagg_decode_spec_steps_total"


def add_parser(sub, common) -> None:
    g = sub.add_parser("spec", parents=[common], help="speculative decoding on and off through the running gateway: "
                       "decode tokens/s, alpha, k, the verify cost the decode nodes measured")
    g.add_argument("--model", required=True, help="a model id of the config (its decode nodes' /metrics are read)")
    g.add_argument("--requests", type=int, default=4, help="grading-like prompts, each sent off and on (default 4)")
    g.add_argument("--scale", type=float, default=1.0, help="prompt lengths (6k-25k tokens) times this")
    g.add_argument("--num-predict", type=int, default=400, help="tokens asked per answer (default 400)")
    g.add_argument("--sampled", action="store_true", help="the app's sampling (temperature 0.2, top_p 0.9, "
                   "seeded) instead of greedy; greedy outputs are compared for equality")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--url", help="the gateway (default: the config's [gateway] address)")
    g.add_argument("--api-key", default=os.environ.get("DISAGG_API_KEY"), help="default: $DISAGG_API_KEY, or the "
                   "first key of the config's [auth]")
    g.add_argument("--timeout", type=float, default=grading.CLIENT_TIMEOUT_S, help="client timeout per request (s)")
    g.add_argument("--json", type=Path, default=Path("spec.json"), help="the result file")
    g.set_defaults(func=main)


def scrape(http, urls: list[str], headers: dict, model: str) -> dict:
    """The model's speculation counters summed over its decode nodes, and every node's measured verify cost and
    step seconds samples ({labels: value})."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {k: 0.0 for k in (*COUNTERS, "verify", "plain", "probe")}
    out["verify_cost"], out["step_seconds"] = {}, {}
    names = {v: k for k, v in COUNTERS.items()}
    for url in urls:
        r = http.get(url + "/metrics", headers=headers, timeout=10)
        r.raise_for_status()
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                if s.labels.get("model") != model:
                    continue
                if s.name in names:
                    out[names[s.name]] += s.value
                elif s.name == STEPS:
                    out[s.labels["kind"]] += s.value
                elif s.name == "disagg_decode_spec_verify_cost":
                    out["verify_cost"][f"{url} k={s.labels['k']} {s.labels['depth']}"] = s.value
                elif s.name == "disagg_decode_spec_step_seconds":
                    out["step_seconds"][f"{url} rows={s.labels['rows']} {s.labels['depth']}"] = s.value
    return out


def send(http, url: str, headers: dict, call: grading.Call, on: bool, sampled: bool) -> dict:
    options = {"num_predict": call.num_predict, "temperature": 0.0}
    if sampled:
        options.update(temperature=0.2, top_p=0.9, seed=call.seed)
    body = {"model": call.model, "prompt": call.prompt, "stream": False, "options": options}
    if call.json_format:
        body["format"] = "json"
    r = http.post(url + "/api/generate", json=body, headers={**headers, SPECULATIVE_HEADER: "on" if on else "off"})
    if r.status_code != 200:
        raise SystemExit(f"the gateway answered {r.status_code}: {r.text[:300]}")
    return r.json()


def run(settings: Settings, args: argparse.Namespace) -> dict:
    httpx = grading.need_httpx()
    route = next((m for m in settings.models if m.id == args.model), None)
    if route is None:
        raise SystemExit(f"--model {args.model!r} is not in the config: {[m.id for m in settings.models]}")
    nodes = [settings.node(n).url for n in route.decode]
    token = settings.auth.node_token()
    node_headers = {"Authorization": f"Bearer {token}"} if token else {}
    key = args.api_key or next(iter(settings.auth.client_keys()), None)
    gw_headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = (args.url or settings.gateway.url()).rstrip("/")
    calls = grading.workload(args.requests, [args.model], args.scale, args.seed)[:args.requests]
    rows = []
    with httpx.Client(timeout=httpx.Timeout(args.timeout, connect=30.0)) as http:
        for i, call in enumerate(calls):
            call.num_predict = args.num_predict
            pair = {}
            for on in ((False, True) if i % 2 == 0 else (True, False)):  # alternate: the machine's load drifts
                before = scrape(http, nodes, node_headers, args.model)
                data = send(http, url, gw_headers, call, on, args.sampled)
                after = scrape(http, nodes, node_headers, args.model)
                delta = {k: after[k] - before[k] for k in (*COUNTERS, "verify", "plain", "probe")}
                pair["on" if on else "off"] = dict(tokens=data.get("eval_count", 0),
                                                  decode_s=data.get("eval_duration", 0) / 1e9,
                                                  response=data.get("response", ""), **delta)
            rows.append(dict(role=call.role, prompt_tokens=data.get("prompt_eval_count", 0), **pair))
        final = scrape(http, nodes, node_headers, args.model)
    return summarize(rows, final, args)


def summarize(rows: list[dict], final: dict, args) -> dict:
    def total(mode: str, key: str) -> float:
        return sum(r[mode][key] for r in rows)

    rate = {m: total(m, "tokens") / max(total(m, "decode_s"), 1e-9) for m in ("off", "on")}
    drafted, accepted, rejections = total("on", "drafted"), total("on", "accepted"), total("on", "rejections")
    verify = total("on", "verify")
    return {"model": args.model, "requests": len(rows), "sampled": args.sampled,
            "decode_tokens_per_s": rate, "ratio_on_off": rate["on"] / max(rate["off"], 1e-9),
            "equal_outputs": sum(r["on"]["response"] == r["off"]["response"] for r in rows),
            "alpha": accepted / max(accepted + rejections, 1e-9), "mean_k": drafted / max(verify, 1e-9),
            "kept_per_verify": accepted / max(verify, 1e-9),
            "steps": {"verify": verify, "plain": total("on", "plain"), "probe": total("on", "probe")},
            "verify_cost": final["verify_cost"], "step_seconds": final["step_seconds"],
            "rows": [{k: v for k, v in r.items()} for r in rows]}


def main(settings: Settings, args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    res = run(settings, args)
    r = res["decode_tokens_per_s"]
    print(f"{res['model']}: {res['requests']} grading-like prompts, each decoded with speculation off and on "
          f"({'sampled' if res['sampled'] else 'greedy'}, {args.num_predict} tokens asked)")
    print(f"  decode tokens/s: off {r['off']:.1f}, on {r['on']:.1f}: {res['ratio_on_off']:.2f}x")
    if not res["sampled"]:
        print(f"  outputs equal on and off: {res['equal_outputs']}/{res['requests']}")
    s = res["steps"]
    print(f"  alpha {res['alpha']:.2f}, mean k {res['mean_k']:.2f}, drafted tokens kept per verify step "
          f"{res['kept_per_verify']:.2f}; steps: {s['verify']:.0f} verify ({s['probe']:.0f} probes), "
          f"{s['plain']:.0f} plain")
    for label, cost in sorted(res["verify_cost"].items()):
        print(f"  measured verify cost {label}: {cost:.3f} of a plain step per drafted token")
    if not res["verify_cost"]:
        print("  no verify cost measured yet (too few steps of each size): the config's verify_cost is in use")
    for label, sec in sorted(res["step_seconds"].items()):
        print(f"  step seconds {label}: {1000 * sec:.1f} ms")
    args.json.write_text(json.dumps(res, indent=1))
    return 0
