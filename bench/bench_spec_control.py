"""The speculative controller before and after issue 48, in one run on this machine: decode ms/token against plain
decoding on bench_spec's grading-like prompts and on a prompt whose first matches are spurious (greedy, outputs
compared), each step's trace; and two generations of one model at once, batched plainly or speculating per row.

Run from the repository root:  .venv/bin/python -m bench.bench_spec_control [--before REV] [--max-tokens 96] [--smoke]

"Before" is the speculative path as it was at REV (default: cab9611, main before issue 48's controller): its engine, controller,
drafters and step modules, read from git into a temporary package and loaded beside today's, on the same weights.
Both run adaptive prompt lookup at the same configured verify_cost (the site files' figures before they became
priors: 0.3 for Qwen3-Coder, 0.55 for gpt-oss): before, that figure is the truth; after, it is the prior until the
node has timed its own steps.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.bench_spec import GRADING, GREEDY, MODEL_DIR, ROOT, prompt_kv, run, use
from backends.decode.engine import Job, MLXModel
from backends.decode.speculative.control import SpecController
from backends.decode.speculative.verify_cost import VerifyCost
from kv_bridge.config.speculative import SpeculativeConfig
from kv_bridge.protocol import Sampling
from tests.support.fakes import HeldKV

BEFORE = "cab9611"  # main before issue 48's source-generic controller was merged
OLD = {"engine": "backends/decode/engine.py", "control": "backends/decode/speculative/control.py",
       "drafters": "backends/decode/speculative/drafters.py", "step": "backends/decode/speculative/step.py"}
# The answer starts in prose (its 2-3-token matches in the prompt are chance), then quotes the code (long matches).
SPURIOUS = ("Rubric: the function must return the mean of a list. Student's code:\ndef mean(values):\n    total = 0\n"
            "    for v in values:\n        total = total + v\n    return total / len(values)\n\nFirst explain in three "
            "sentences what the code does and whether it is correct, then quote the student's code exactly in a "
            "```python block.")


def load_before(rev: str, folder: Path):
    """The MLXModel class of the speculative path at `rev`, from a package `spec_before` written under `folder`."""
    pkg = folder / "spec_before"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, path in OLD.items():
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        for mod in ("control", "drafters", "step"):
            text = text.replace(f"backends.decode.speculative.{mod}", f"spec_before.{mod}")
        (pkg / f"{name}.py").write_text(text)
    # a package by its own path (no sys.path edit): its modules import one another as spec_before.*
    spec = importlib.util.spec_from_file_location("spec_before", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    sys.modules["spec_before"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["spec_before"])
    return importlib.import_module("spec_before.engine")


def trace_of(r: dict) -> str:
    return "".join(str(min(k, 9)) if k else "." for k, _ in r["ks"]) + ("|" if r["handed"] else "")


def before_after(models, prompts, cost: float, max_tokens: int) -> None:
    """Plain, before and after, per prompt, alternating (this machine's load drifts). Each side's controller lives
    across the prompts, as a node's does across its generations."""
    (new, old), rows = models, {"plain": [0, 0.0], "before": [0, 0.0], "after": [0, 0.0]}
    equal = {"before": 0, "after": 0}
    cfg = SpeculativeConfig(method="prompt_lookup", verify_cost=cost, probe_every=8)
    ctl_before, ctl_after = old.module_ctl(cfg), SpecController(cfg)
    for label, ids, kv in prompts:
        use(new, method="off")
        plain = run(new, ids, kv, GREEDY, max_tokens)
        old.speculation = ctl_before
        before = run(old, ids, kv, GREEDY, max_tokens)
        new.speculation = ctl_after
        after = run(new, ids, kv, GREEDY, max_tokens)
        for name, r in (("plain", plain), ("before", before), ("after", after)):
            rows[name][0] += len(r["tokens"])
            rows[name][1] += r["seconds"]
        for name, r in (("before", before), ("after", after)):
            equal[name] += r["tokens"] == plain["tokens"]
        print(f"  {label:9s} before: {trace_of(before)}")
        print(f"  {'':9s} after:  {trace_of(after)}")
    ms = {k: 1000 * sec / max(n, 1) for k, (n, sec) in rows.items()}
    costs = ", ".join(f"k={k} {c:.2f}" for k, _, c in ctl_after.meter.costs()) or "too few samples"
    print(f"  verify_cost {cost}: plain {ms['plain']:.0f} ms/token; before {ms['before']:.0f} "
          f"({ms['before'] / ms['plain']:.2f}x plain's time, {equal['before']}/{len(prompts)} equal); after "
          f"{ms['after']:.0f} ({ms['after'] / ms['plain']:.2f}x, {equal['after']}/{len(prompts)} equal); "
          f"after / before {ms['after'] / ms['before']:.2f}x; after measured verify_cost: {costs}")


class _PerRow(SpecController):
    """Speculates every generation on its own, however many there are (to measure what it costs)."""

    def share(self, n: int) -> bool:
        return True


def together(m: MLXModel, prompts, kvs, max_tokens: int, mode: str, meter) -> tuple[float, list, dict]:
    """Two generations submitted at once: (decode tokens/s over both, their tokens, how they ran). `meter`: one
    VerifyCost across the runs (the batch's steps timed in the plain runs, the speculative path's in the others)."""
    cfg = SpeculativeConfig(method="prompt_lookup" if mode != "off" else "off", verify_cost=0.06)
    m.speculation = (_PerRow if mode == "per_row" else SpecController)(cfg, meter=meter)
    outs, dones, stamps = [], [], []
    t0 = time.perf_counter()
    for ids, kv in zip(prompts, kvs):
        out, done = [], threading.Event()

        def emit(ev, out=out, done=done):
            if ev is None:
                done.set()
            else:
                out.append(ev[1].token_id)
                stamps.append(time.perf_counter())
        m.submit(Job(tokens=ids[-1:], gen=Sampling.from_json({"max_tokens": max_tokens, **GREEDY}), emit=emit,
                     history=ids[:-1], make_cache=lambda kv=kv: m.prompt_cache(None, HeldKV(*kv))))
        outs.append(out)
        dones.append(done)
    for d in dones:
        d.wait()
    return sum(map(len, outs)) / (max(stamps) - t0), outs, dict(m.speculation.stats.requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default=BEFORE, help=f"the git revision of 'before' (default {BEFORE}: main before "
                    "issue 48's controller)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--smoke", action="store_true", help="8 tokens, one configured cost: the bench runs, no figure")
    a = ap.parse_args()
    if a.smoke:
        a.max_tokens = 8
    rev = subprocess.run(["git", "rev-parse", a.before], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old_mod = load_before(rev, Path(tmp))
        new, old = MLXModel("smollm2:135m", str(MODEL_DIR)), old_mod.MLXModel("smollm2:135m", str(MODEL_DIR))
        for m in (new, old):
            m.executor.submit(m.load).result()
            m.start()
        old.module_ctl = importlib.import_module("spec_before.control").SpecController
        chat = lambda t: new.tokenizer.apply_chat_template([{"role": "user", "content": t}],  # noqa: E731
                                                           add_generation_prompt=True)
        prompts = [(f"grading{i}", chat(t)) for i, t in enumerate(GRADING)] + [("spurious", chat(SPURIOUS))]
        prompts = [(label, ids, prompt_kv(new, ids)) for label, ids in prompts]
        print(f"before = {rev[:10]}; prompts {[len(ids) for _, ids, _ in prompts]} tokens; max_tokens {a.max_tokens};"
              f" greedy; SmolLM2-135M float32 on mlx-cpu (drafted per step: '.' none, '|' handed to the batch)")
        for cost in (0.3,) if a.smoke else (0.3, 0.55):
            before_after((new, old), prompts, cost, a.max_tokens)
        two = [ids for _, ids, _ in prompts[:2]], [kv for _, _, kv in prompts[:2]]
        meter = VerifyCost(0.06)
        print("\nTwo generations at once (the grading prompts), decode tokens/s over both (second of two runs each):")
        got = {}
        for mode in ("off", "per_row", "off", "per_row"):
            got[mode] = together(new, *two, a.max_tokens, mode, meter)
        for mode in ("off", "per_row"):
            print(f"  {mode:8s}: {got[mode][0]:.2f} tokens/s; outputs equal to batched plain: "
                  f"{got[mode][1] == got['off'][1]}; ran {got[mode][2]}")
        print(f"  per-row speculation / plain batch: {got['per_row'][0] / got['off'][0]:.2f}x (measured batch step "
              f"of 2: {meter.batch_seconds(2)}; the speculative path's measured (tokens/s, steps): {meter.path_rate()})")
        rate, outs, ran = together(new, *two, a.max_tokens, "adaptive", meter)
        print(f"  adaptive (SpecController.share on the measured costs): {rate:.2f} tokens/s, ran {ran}; outputs "
              f"equal: {outs == got['off'][1]}")
        for m in (new, old):
            m.stop()
            m.executor.shutdown(wait=True)  # each MLX thread ends before the interpreter: else std::terminate at exit


if __name__ == "__main__":
    main()
    # Out without the interpreter's teardown: MLX's C++ threads can still be joinable then, and std::terminate
    # aborts a run whose results are already printed (rc -6 in a clean clone's smoke, after the executor's join)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
