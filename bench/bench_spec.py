"""Speculative decoding on the decode node: tokens accepted per verify step, drafted/accepted counts, output equality
with plain decoding and the node's own cost per step, for prompt lookup and a draft model, greedy and sampled, on
grading-like requests (a rubric and a student's code; answers that quote it) and on prompts that share nothing with
their answers; the controller turning drafting down by itself; and the site prediction (docs/speculative.md).

Run from the repository root:  .venv/bin/python -m bench.bench_spec [--max-tokens 48] [--num-draft 4] [--quick]

What this machine can show: mlx-cpu is compute-bound here, a forward of n tokens costs about n times one token's
(SmolLM2 float32: 125 ms for 1 token, 470 ms for 4), so speculative decoding is slower here per generated token and
the ms/token ratio printed is this machine's, not a Mac's. What transfers: tokens per verify step and acceptance.
Each prompt is prefilled once and its KV handed to every run as bridged KV is (a fresh cache built from it), so the
runs decode from the same state through the decode node's own MLX loop (backends/decode/engine.py).
The draft model is a layer-truncated copy of SmolLM2 (26 of 30 layers, built here, untrained): the embedded model
has no smaller sibling; it shows the mechanism and its counts, not what a trained draft would accept.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from backends.decode.engine import Job, MLXModel
from backends.decode.speculative.drafters import load_draft, truncated_draft
from backends.decode.speculative.control import SpecController
from kv_bridge.config.speculative import SpeculativeConfig
from kv_bridge.protocol import Sampling

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


class _KV:
    """The received-KV interface MLXModel.prompt_cache takes (kv.keys, kv.values, release())."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def release(self):
        pass


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
    s0 = dict(vars(m.speculation.stats))
    s0.pop("requests")
    ks = []
    record = m.speculation.record

    def traced(drafted, accepted):
        ks.append((drafted, accepted))
        record(drafted, accepted)
    m.speculation.record = traced
    gen = Sampling.from_json({"max_tokens": max_tokens, **sampling})
    t0 = time.perf_counter()
    m.submit(Job(tokens=ids[-1:], gen=gen, emit=emit, history=ids[:-1],
                 make_cache=lambda: m.prompt_cache(None, _KV(*kv))))
    done.wait()
    m.speculation.record = record
    s = m.speculation.stats
    d = {k: getattr(s, k) - v for k, v in s0.items()}
    return dict(tokens=[e[1].token_id for e in out if e[0] == "token"], seconds=(stamps[-1] - t0) if stamps else 0,
                ks=ks, **d)


def use(m: MLXModel, **cfg) -> None:
    m.speculation = SpecController(SpeculativeConfig(**cfg))


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
    """The adaptive controller at a given cost: tokens drafted per step ('.': none, the controller is off or the
    n-gram lookup found no match)."""
    use(m, method=method, draft_path="built", num_draft=num_draft, verify_cost=verify_cost, draft_cost=draft_cost,
        probe_every=8)
    ks = []
    for ids, kv in zip(prompts, kvs):
        ks += [d for d, _ in run(m, ids, kv, GREEDY, max_tokens)["ks"]]
    c = m.speculation
    print(f"  {label:9s} {method:13s} cost {verify_cost:.2f}+{draft_cost:.2f}: drafted per step "
          f"{''.join(str(k) if k else '.' for k in ks)}; acceptance EWMA {c.rate:.2f}, draft length now {c.k}")


# Site prediction (docs/speculative.md). Verify cost on Metal: llama.cpp PR #10581 (ggml-org/llama.cpp, "metal:
# small-batch mat-mul kernels", qwen2 7B Q8_0, after the PR): pp1 70.41, pp2 126.66, pp4 200.40, pp5 207.24,
# pp8 260.76 tokens/s, i.e. a forward of n tokens costs this many single-token forwards:
DENSE_COST = {1: 1.0, 2: 2 * 70.41 / 126.66, 4: 4 * 70.41 / 200.40, 5: 5 * 70.41 / 207.24, 8: 8 * 70.41 / 260.76}
# MoE: n tokens route to up to n * top_k distinct experts per layer, each read from memory. Shapes from each
# model's config.json (hidden, layers, q/kv heads x head_dim, experts, top_k, expert intermediate, vocab).
SITE = {"qwen3-coder:30b (Qwen3-Coder-30B-A3B)": dict(h=2048, L=48, q=32 * 128, kv=4 * 128, E=128, top=8, ffn=768,
                                                         vocab=151936),
        "gpt-oss:120b": dict(h=2880, L=36, q=64 * 64, kv=8 * 64, E=128, top=4, ffn=2880, vocab=201088)}


def dense_cost(n: int) -> float:
    """Single-token forwards a forward of n tokens costs (interpolated in the published figures)."""
    xs = sorted(DENSE_COST)
    for a, b in zip(xs, xs[1:]):
        if a <= n <= b:
            return DENSE_COST[a] + (DENSE_COST[b] - DENSE_COST[a]) * (n - a) / (b - a)
    return DENSE_COST[xs[-1]] * n / xs[-1]


def moe_cost(s: dict, n: int) -> float:
    """Forward of n tokens over one token's, memory-bound: the dense part (attention, LM head) as the dense figures
    say, the expert part by the expected distinct experts (independent routing: an upper bound)."""
    dense = s["L"] * (2 * s["h"] * s["q"] + 2 * s["h"] * s["kv"]) + s["vocab"] * s["h"]
    expert = 3 * s["h"] * s["ffn"]
    active = s["L"] * s["top"] * expert
    distinct = s["E"] * (1 - (1 - s["top"] / s["E"]) ** n) / s["top"]
    return (dense * dense_cost(n) + active * distinct) / (dense + active)


def replay(steps: list[tuple[int, int]], k: int, cost) -> float:
    """Decode speedup over plain steps if each measured step had drafted at most k: a step that kept a drafted
    tokens keeps min(a, k) (acceptance is prefix by prefix) and costs cost(k + 1); a step that drafted nothing
    costs one plain step. Tokens per unit of time, over plain decoding's one per step."""
    tokens = sum(1 + min(a, k) if d else 1 for d, a in steps)
    time_ = sum(cost(min(d, k) + 1) if d else 1.0 for d, a in steps)
    return tokens / time_


def predict(steps: list[tuple[int, int]], num_draft: int) -> None:
    drafted = [st for st in steps if st[0]]
    print(f"\nSite prediction (Mac Studio, memory-bound decode): the grading-like prompt-lookup steps above replayed "
          f"({len(steps)} steps, {len(drafted)} drafted, {sum(a for _, a in steps)} tokens kept) with each model's cost "
          "of verifying k+1 tokens:")
    models = {"dense 7B (llama.cpp figures, for scale)": dense_cost,
              **{name: (lambda n, s=s: moe_cost(s, n)) for name, s in SITE.items()}}
    for name, cost in models.items():
        gains = {k: replay(steps, k, cost) for k in range(1, num_draft + 1)}
        k = max(gains, key=gains.get)
        # A 25k-token grading prompt: ~20 s prefill on a Spark, 3,000 tokens at 60 tokens/s (docs/deploy.md).
        before, after = 20 + 3000 / 60, 20 + 3000 / 60 / gains[k]
        print(f"  {name}: verify of 2/3/5 tokens = {cost(2):.2f}/{cost(3):.2f}/{cost(5):.2f} plain steps; best k={k}: "
              f"decode {gains[k]:.2f}x; a grading request {before:.0f} s -> {after:.0f} s; "
              f"{'pays' if gains[k] > 1.05 else 'does not pay: leave it off'}")
    print("  gpt-oss:120b: its sliding-window layers (RotatingKVCache, 128 tokens) can be trimmed only while the window "
          "has room, so past 128 tokens the node drafts nothing for it anyway.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="one prompt per kind, no draft model")
    a = ap.parse_args()
    m = MLXModel("smollm2:135m", str(MODEL_DIR))
    m.load()
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
          "included; same: outputs equal to plain decoding; ms/token and vs plain: this machine, compute-bound)")
    plain_ms = next(r[8] for r in rows if r[2] == "plain")
    print(f"\nController (adaptive, greedy). Verify cost 0.15 a drafted token: a Mac, dense model (llama.cpp figures "
          f"below); 1.00: this machine (plain {plain_ms:.0f} ms/token, verify ~linear in tokens); the draft model "
          "adds its own cost, 26/30 of a target step here:")
    for cost in (0.15, 1.0):
        controller(m, g_ids, g_kv, "grading", a.max_tokens, a.num_draft, "prompt_lookup", cost)
        controller(m, u_ids, u_kv, "unrelated", a.max_tokens, a.num_draft, "prompt_lookup", cost)
    if not a.quick:
        controller(m, u_ids, u_kv, "unrelated", a.max_tokens, 3, "draft", 0.15, 26 / 30)
    predict(steps, a.num_draft)
    m.stop()


if __name__ == "__main__":
    main()
