"""Speculative decoding on the decode node: tokens accepted per verify step, drafted/accepted counts, output equality
with plain decoding and the node's own cost per step, for prompt lookup and a draft model, greedy and sampled, on
grading-like requests (a rubric and a student's code; answers that quote it) and on prompts that share nothing with
their answers; the controller turning drafting down by itself; and the site prediction (docs/speculative.md).

Run from the repository root:  .venv/bin/python -m bench.bench_spec [--max-tokens 48] [--num-draft 4] [--quick]

What this machine can show: mlx-cpu on OpenBLAS (backends/host_blas.py) is memory-bound in decode here as a Mac is,
so a verify forward over k+1 tokens costs little more than one plain step; the bench measures that cost and runs the
controller at it, beside each site model's. On mlx's own reference BLAS a forward of n tokens cost about n times
one token's and speculation could not pay here. The ms/token ratio is this machine's, not a Mac's.
Each prompt is prefilled once and its KV handed to every run as bridged KV is (a fresh cache built from it), so the
runs decode from the same state through the decode node's own MLX loop (backends/decode/engine.py).
The draft model is a layer-truncated copy of SmolLM2 (26 of 30 layers, built here, untrained): the embedded model
has no smaller sibling; it shows the mechanism and its counts, not what a trained draft would accept.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from backends.decode.engine import Job, MLXModel
from backends.decode.speculative.drafters import load_draft, truncated_draft
from backends.decode.speculative.control import SpecController
from backends.decode.speculative.gain import SHAPES, forward_cost, verify_cost
from kv_bridge.config.speculative import SpeculativeConfig
from kv_bridge.protocol import Sampling
from tests.support.fakes import HeldKV

MODEL_DIR = ROOT / "models" / "smollm2-135m"
DRAFT_SKIP = (12, 15, 18, 21)  # middle layers the draft drops (of 30): the best agreement of the few tried
RUBRIC = ("Rubric (10 points): 4 points if area() returns width times height; 4 points if perimeter() returns "
          "twice the sum of width and height; 2 points for clear names. Quote the line of code each point is about.")
STUDENT = ["def area(width, height):\n    return width * height\n\ndef perimeter(width, height):\n"
           "    return width + height\n",
           "def total(prices):\n    result = 0\n    for p in prices:\n        result = result + p\n    return result\n\n"
           "def average(prices):\n    return total(prices) / len(prices)\n"]
GRADING = [f"{RUBRIC}\n\nStudent's code:\n{code}\nGrade the code. First quote the student's code in a ```python "
           "block, then list the points it earns." for code in STUDENT]
UNRELATED = ["Write a short poem about the sea at night.", "Give three tips for learning to ride a bicycle."]
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.3, "top_p": 0.9, "seed": 11}  # the lab's settings (docs/site.md), seeded to compare


def prompt_kv(m: MLXModel, ids: list[int]):
    """MLX's own prefill of ids[:-1] as (L, H, T, D) keys and values: what a bridged transfer would bring."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import cache_kv

    cache = make_prompt_cache(m.model)
    m.model(mx.array([ids[:-1]]), cache=cache)
    return cache_kv(cache, len(ids) - 1)


def run(m: MLXModel, ids, kv, sampling: dict, max_tokens: int) -> dict:
    """One generation through the MLX loop from the prompt's KV; tokens, decode time and the controller's deltas."""
    out, done = [], threading.Event()
    stamps = []

    def emit(ev):
        if ev is None:
            done.set()
        else:
            stamps.append(time.perf_counter())
            out.append(ev)
    s0 = {k: v for k, v in vars(m.speculation.stats).items() if isinstance(v, int)}
    r0 = dict(m.speculation.stats.requests)
    m.speculation.trace = trace = []
    gen = Sampling.from_json({"max_tokens": max_tokens, **sampling})
    t0 = time.perf_counter()
    job = getattr(sys.modules[type(m).__module__], "Job", Job)  # the engine's own (bench_spec_control loads an old one)
    m.submit(job(tokens=ids[-1:], gen=gen, emit=emit, history=ids[:-1],
                 make_cache=lambda: m.prompt_cache(None, HeldKV(*kv))))
    done.wait()
    m.speculation.trace = None
    s = m.speculation.stats
    d = {k: getattr(s, k) - v for k, v in s0.items()}
    handed = sum(n - r0.get(why, 0) for why, n in s.requests.items() if why != "speculative")
    return dict(tokens=[e[1].token_id for e in out if e[0] == "token"], seconds=(stamps[-1] - t0) if stamps else 0,
                ks=[(t, 0) if isinstance(t, int) else t[1:] for t in trace], handed=handed, stamps=[t - t0 for t in stamps], **d)


def use(m: MLXModel, **cfg) -> None:
    m.speculation = SpecController(SpeculativeConfig(**cfg))  # measures its verify cost afresh


def section(m, prompts, kvs, label, max_tokens, num_draft, draft_ok):
    """Plain, prompt lookup and draft model, greedy and sampled, over `prompts`: one row per (method, mode), and
    prompt lookup's (drafted, accepted) per step, which the site prediction replays."""
    rows, trace = [], []
    for mode, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
        use(m, method="off")
        plain = [run(m, ids, kv, sampling, max_tokens) for ids, kv in zip(prompts, kvs)]
        p_tok = sum(len(r["tokens"]) for r in plain)
        p_s = sum(r["seconds"] for r in plain)
        rows.append((label, mode, "plain", 0, 0, 0, 0, "-", 1000 * p_s / p_tok, 1.0))
        methods = [("prompt_lookup", dict(method="prompt_lookup", num_draft=num_draft, adaptive=False))]
        if draft_ok:
            methods.append(("draft", dict(method="draft", draft_path="built", num_draft=min(num_draft, 3),
                                          adaptive=False)))
        for name, cfg in methods:
            use(m, **cfg)
            rs = [run(m, ids, kv, sampling, max_tokens) for ids, kv in zip(prompts, kvs)]
            trace += [st for r in rs for st in r["ks"]] if name == "prompt_lookup" else []
            same = sum(r["tokens"] == p["tokens"] for r, p in zip(rs, plain))
            tok = sum(len(r["tokens"]) for r in rs)
            sec = sum(r["seconds"] for r in rs)
            drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
            verify = sum(r["verify_steps"] for r in rs)
            steps = verify + sum(r["plain_steps"] for r in rs)
            rows.append((label, mode, name, drafted, accepted, verify, tok / max(steps, 1), f"{same}/{len(rs)}",
                         1000 * sec / tok, (sec / tok) / (p_s / p_tok)))
    return rows, trace


def controller(m, prompts, kvs, label, max_tokens, num_draft, method, verify_cost, draft_cost=0.0):
    """The adaptive controller at a given prior cost (the node measures its own after cost_samples steps): tokens
    drafted per step ('.': none, the controller is off or no source had a proposal; '|': the generation went to the
    batch)."""
    use(m, method=method, draft_path="built", num_draft=num_draft, verify_cost=verify_cost, draft_cost=draft_cost,
        probe_every=8)
    trace = []
    for ids, kv in zip(prompts, kvs):
        r = run(m, ids, kv, GREEDY, max_tokens)
        trace.append("".join(str(k) if k else "." for k, _ in r["ks"]) + ("|" if r["handed"] else ""))
    c = m.speculation
    print(f"  {label:9s} {method:13s} cost {verify_cost:.2f}+{draft_cost:.2f}: {' / '.join(trace)}; alpha "
          f"{c.rate:.2f}, k now {c.k}")


def machine_verify_cost(m: MLXModel, ids, kv, k: int, reps: int = 5) -> tuple[float, float, float]:
    """This machine's price of a verify forward: (ms for 1 token, ms for k+1 tokens, verify_cost = (t(k+1) / t(1) - 1)
    / k), each the median of `reps` forwards over the prompt's bridged cache, trimmed back after each. Called while
    the MLX loop is idle, as prompt_kv is."""
    import statistics

    import mlx.core as mx
    from mlx_lm.models.cache import trim_prompt_cache

    cache = m.prompt_cache(None, HeldKV(*kv))

    def seconds(n: int) -> float:
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            mx.eval(m.model(mx.array([ids[-1:] * n]), cache=cache))
            times.append(time.perf_counter() - t0)
            trim_prompt_cache(cache, n)
        return statistics.median(times[1:])

    one, many = seconds(1), seconds(k + 1)
    return 1000 * one, 1000 * many, max(0.0, (many / one - 1) / k)


class _PlainOnly(SpecController):
    """The speculative path with nothing drafted: its plain steps, timed."""

    def choose(self, proposals, depth, limit):
        return None

    def would_verify(self, proposals, depth, limit):
        return False


def plain_steps(m, prompts, kvs, max_tokens: int) -> None:
    """Wall-clock per token after the first, the speculative path's plain steps against the batch's, same run,
    alternating (this machine's load drifts)."""
    spec = batch = 0.0
    n = 0
    for _ in range(2):
        for ids, kv in zip(prompts, kvs):
            use(m, method="off")
            b = run(m, ids, kv, GREEDY, max_tokens)
            m.speculation = _PlainOnly(SpeculativeConfig(method="prompt_lookup", adaptive=False))
            p = run(m, ids, kv, GREEDY, max_tokens)
            assert p["tokens"] == b["tokens"] and p["verify_steps"] == 0
            batch += b["stamps"][-1] - b["stamps"][0]
            spec += p["stamps"][-1] - p["stamps"][0]
            n += len(b["stamps"]) - 1
    print(f"\nPlain steps: speculative path {1000 * spec / n:.1f} ms/token, batch path {1000 * batch / n:.1f} ms/token "
          f"({n} tokens each): speculative / batch = {spec / batch:.2f}x (both pipelined: step n+1 is built and "
          "started while step n evaluates)")


def predict(steps: list[tuple[int, int]], num_draft: int) -> None:
    """The measured prompt-lookup steps replayed with each site model's verify cost at the class's prompt lengths
    (backends/decode/speculative/gain.py: weights and KV read once per forward, experts per token routed)."""
    drafted = [st for st in steps if st[0]]
    print(f"\nSite prediction (Mac, memory-bound decode): the grading-like prompt-lookup steps above replayed "
          f"({len(steps)} steps, {len(drafted)} drafted, {sum(a for _, a in steps)} tokens kept) with each model's "
          "cost of a forward over k+1 tokens at 6k / 15k / 25k tokens of context:")
    for family, name in (("qwen3_moe", "qwen3-coder:30b"), ("gpt_oss", "gpt-oss:120b")):
        for ctx in (6000, 15000, 25000):
            cost = lambda n, c=ctx: forward_cost(SHAPES[family], c, n)  # noqa: E731
            gains = {k: replay(steps, k, cost) for k in range(1, num_draft + 1)}
            k = max(gains, key=gains.get)
            print(f"  {name:16s} {ctx:6d}: forward of 2/3/5 tokens = {cost(2):.2f}/{cost(3):.2f}/{cost(5):.2f} "
                  f"plain steps (verify_cost at k=4: {verify_cost(SHAPES[family], ctx, 4):.2f}); best k={k}: "
                  f"decode {gains[k]:.2f}x")


def replay(steps: list[tuple[int, int]], k: int, cost) -> float:
    """Decode speedup over plain steps if each measured step had drafted at most k: a step that kept a drafted
    tokens keeps min(a, k) (acceptance is prefix by prefix) and costs cost(k + 1); a step that drafted nothing
    costs one plain step. Tokens per unit of time, over plain decoding's one per step."""
    tokens = sum(1 + min(a, k) if d else 1 for d, a in steps)
    time_ = sum(cost(min(d, k) + 1) if d else 1.0 for d, a in steps)
    return tokens / time_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="one prompt per kind, no draft model")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    a = ap.parse_args()
    if a.smoke:
        a.quick, a.max_tokens = True, 8
    m = MLXModel("smollm2:135m", str(MODEL_DIR))
    m.executor.submit(m.load).result()  # on the model's own thread, as the node loads it
    m.start()
    grading, unrelated = (GRADING[:1], UNRELATED[:1]) if a.quick else (GRADING, UNRELATED)
    chat = [lambda t: m.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)]
    g_ids, u_ids = [chat[0](t) for t in grading], [chat[0](t) for t in unrelated]
    t0 = time.perf_counter()
    g_kv, u_kv = [prompt_kv(m, i) for i in g_ids], [prompt_kv(m, i) for i in u_ids]
    print(f"prompts: grading {[len(i) for i in g_ids]} tokens, unrelated {[len(i) for i in u_ids]}; prefilled once "
          f"in {time.perf_counter() - t0:.0f} s; max_tokens {a.max_tokens}, num_draft {a.num_draft}")
    with tempfile.TemporaryDirectory() as tmp:
        if not a.quick:
            keep = [i for i in range(30) if i not in DRAFT_SKIP]
            m.draft_model = load_draft(truncated_draft(str(MODEL_DIR), tmp + "/draft", keep), m.tokenizer,
                                       m.vocab_size)
        rows, steps = section(m, g_ids, g_kv, "grading", a.max_tokens, a.num_draft, not a.quick)
        rows += section(m, u_ids, u_kv, "unrelated", a.max_tokens, a.num_draft, not a.quick)[0]
    print(f"\n{'prompts':9s} {'mode':7s} {'method':13s} {'drafted':>7s} {'accepted':>8s} {'verify':>6s} "
          f"{'acc/verify':>10s} {'tok/step':>8s} {'same':>5s} {'ms/token':>8s} {'vs plain':>8s}")
    for label, mode, name, dr, ac, ve, per_step, same, ms, ratio in rows:
        acc = f"{ac / ve:.2f}" if ve else "-"
        print(f"{label:9s} {mode:7s} {name:13s} {dr:7d} {ac:8d} {ve:6d} {acc:>10s} {per_step:8.2f} {same:>5s} "
              f"{ms:8.0f} {ratio:7.2f}x")
    print("(acc/verify: drafted tokens kept per verify step; tok/step: tokens per target forward, plain steps "
          "included; same: outputs equal to plain decoding; ms/token and vs plain: this machine)")
    one_ms, many_ms, here = machine_verify_cost(m, g_ids[0], g_kv[0], a.num_draft)
    print(f"\nController (adaptive prompt lookup, greedy, probe_every 8), drafted per step. At a Mac's verify cost for "
          f"each site model (gain.py at 15k tokens of context, k = 4), and at this machine's, measured: a forward of 1 "
          f"token {one_ms:.1f} ms, of {a.num_draft + 1} tokens {many_ms:.1f} ms: verify_cost {here:.2f}")
    for family, name in (("qwen3_moe", "qwen3-coder"), ("gpt_oss", "gpt-oss")):
        cost = round(verify_cost(SHAPES[family], 15000, 4), 2)
        print(f" {name} (verify_cost {cost}):")
        controller(m, g_ids, g_kv, "grading", a.max_tokens, a.num_draft, "prompt_lookup", cost)
        controller(m, u_ids, u_kv, "unrelated", a.max_tokens, a.num_draft, "prompt_lookup", cost)
    print(f" this machine (verify_cost {here:.2f}):")
    controller(m, g_ids, g_kv, "grading", a.max_tokens, a.num_draft, "prompt_lookup", round(here, 2))
    controller(m, u_ids, u_kv, "unrelated", a.max_tokens, a.num_draft, "prompt_lookup", round(here, 2))
    if not a.quick:
        controller(m, u_ids, u_kv, "unrelated", a.max_tokens, 3, "draft", round(here, 2), 26 / 30)
    plain_steps(m, g_ids, g_kv, a.max_tokens)
    predict(steps, a.num_draft)
    m.stop()
    m.executor.shutdown(wait=True)  # the MLX thread ends before the interpreter: else std::terminate at exit


if __name__ == "__main__":
    main()
    # Out without the interpreter's teardown: MLX's C++ threads can still be joinable then, and std::terminate
    # aborts a run whose results are already printed (rc -6 in a clean clone's smoke, after the executor's join)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
