"""Drafting sources on a replayed grading class, offline: the class's greedy answers (SmolLM2-135M, mlx-lm in-process,
cached) replayed token by token through each source at a fixed k, counting what a verify step would keep. No stack,
no timing of the model: what each source can give before any controller or speculative path loses some of it.

Run from the repository root:  .venv/bin/python -m bench.bench_class_drafts [--submissions 20] [--answer-tokens 200]
[--k 3] [--smoke]

Sources: prompt lookup (backends/decode/speculative/drafters.py), suffix decoding over the generation's prompt and
text only, over those and the class's earlier answers of the same call (the analysis answers' store and the feedback
answers' store, as the site's two models each keep their own), and both (the suffix draft where it has one, else
prompt lookup's). The class is replayed in order, so the first submissions find an empty store.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from backends.decode.speculative.drafters import PromptLookup
from backends.decode.speculative.suffix import SuffixDrafter, SuffixStore
from backends.grading import spec_class

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "smollm2-135m"
CACHE = ROOT / ".disagg" / "bench"
SOURCES = ("prompt_lookup", "suffix_prompt", "suffix_class", "both")


class Both:
    """Of suffix decoding's draft (prompt and class) and prompt lookup's, the one matched on the longer context (a
    stand-in for the node's controller, which chooses by each source's measured acceptance at that match length)."""

    def __init__(self, seq: list[int], store: SuffixStore) -> None:
        self.suffix, self.lookup = SuffixDrafter(seq, store), PromptLookup(seq, 2, 4)
        self.match_len = 0

    def draft(self, k: int) -> list[int]:
        d = self.suffix.draft(k)
        self.match_len = self.suffix.match_len
        other = self.lookup.draft(k)
        n = getattr(self.lookup, "match_len", None)  # the drafting-source interface; else the n-gram it matched on
        if n is None:
            seq = self.lookup.seq
            n = next((n for n in self.lookup.sizes if len(seq) >= n and tuple(seq[-n:]) in self.lookup.index[n]), 0)
        if other and n > self.match_len:
            self.match_len = n
            return other
        return d or other

    def prefill_step(self) -> bool:
        return self.suffix.prefill_step()

    def finish(self) -> None:
        self.suffix.finish()


def drafter(source: str, seq: list[int], store: SuffixStore):
    if source == "prompt_lookup":
        return PromptLookup(seq, 2, 4)
    if source == "suffix_prompt":
        return SuffixDrafter(seq)
    if source == "suffix_class":
        return SuffixDrafter(seq, store)
    return Both(seq, store)


def replay(prompt: list[int], answer: list[int], d, seq: list[int], k: int) -> dict:
    """Greedy decoding of `answer` with drafts from d: each step keeps the drafted tokens that agree with the answer
    and emits one more (the target's own); a step with no draft is a plain step."""
    st = {"forwards": 0, "verify": 0, "drafted": 0, "kept": 0, "rejections": 0, "tokens": len(answer), "draft_s": 0.0,
          "index_s": 0.0, "prompt": len(prompt)}
    t0 = time.perf_counter()
    while d.prefill_step():  # the prompt's index, built while the node prefills (a chunk per loop step)
        pass
    st["index_s"] = time.perf_counter() - t0
    pos = 0
    while pos < len(answer):
        t0 = time.perf_counter()
        draft = d.draft(min(k, len(answer) - pos - 1))
        st["draft_s"] += time.perf_counter() - t0
        kept = 0
        while kept < len(draft) and draft[kept] == answer[pos + kept]:
            kept += 1
        st["forwards"] += 1
        if draft:
            st["verify"] += 1
            st["drafted"] += len(draft)
            st["kept"] += kept
            st["rejections"] += kept < len(draft)
        seq.extend(answer[pos:pos + kept + 1])
        pos += kept + 1
    return st


def measure(data: list[dict], k: int) -> dict[str, dict]:
    """Per source and call role: the replay's counts summed over the class."""
    out: dict[str, dict] = {}
    for source in SOURCES:
        stores = {"analysis": SuffixStore(), "feedback": SuffixStore()}
        for row in data:
            seq = list(row["prompt"])
            d = drafter(source, seq, stores[row["role"]])
            st = replay(row["prompt"], row["answer"], d, seq, k)
            if hasattr(d, "finish"):
                d.finish()
            for key in (row["role"], "all"):
                acc = out.setdefault(source, {}).setdefault(key, dict.fromkeys(st, 0))
                for name, v in st.items():
                    acc[name] += v
    return out


def report(out: dict[str, dict], k: int) -> None:
    print(f"\nper source at k = {k} (kept / verify step: drafted tokens the target kept per verify step; match: verify "
          "steps / all steps; alpha: kept / (kept + rejections); tokens / forward: the decode's own speed-up bound)")
    print(f"{'source':>14} {'call':>9} {'tokens':>7} {'match':>6} {'drafted/verify':>14} {'kept/verify':>11} {'alpha':>6} "
          f"{'tokens/fwd':>10} {'us/draft':>9} {'us/prompt token':>15}")
    for source, by_role in out.items():
        for role, s in by_role.items():
            match = s["verify"] / max(s["forwards"], 1)
            per = s["kept"] / max(s["verify"], 1)
            alpha = s["kept"] / max(s["kept"] + s["rejections"], 1)
            drafted = s["drafted"] / max(s["verify"], 1)
            print(f"{source:>14} {role:>9} {s['tokens']:>7} {match:>6.2f} {drafted:>14.2f} {per:>11.2f} {alpha:>6.2f} "
                  f"{s['tokens'] / max(s['forwards'], 1):>10.2f} {1e6 * s['draft_s'] / max(s['forwards'], 1):>9.0f} "
                  f"{1e6 * s['index_s'] / max(s['prompt'], 1):>15.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--submissions", type=int, default=20)
    ap.add_argument("--answer-tokens", type=int, default=200, help="greedy answer length cap (generated once, cached)")
    ap.add_argument("--k", type=int, default=3, help="tokens drafted per step at most (3: MLX's fused attention)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--cache-dir", type=Path, default=CACHE)
    ap.add_argument("--smoke", action="store_true", help="two submissions of ~600 tokens, 12-token answers")
    ap.add_argument("--answers", type=Path, help="replay these answers instead (bench/bench_class_spec.py "
                    "--save-answers: the stack's own greedy answers to the same class)")
    ap.add_argument("--cached", action="store_true", help="generate nothing: measure the submissions whose answers "
                    "are cached (another run may still be generating the rest)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.submissions, args.answer_tokens = 2, 12
    from transformers import AutoTokenizer

    if args.answers:
        import json

        data = json.loads(args.answers.read_text())
        print(f"answers from {args.answers}: {len({r['submission'] for r in data})} submissions, prompts "
              f"{min(len(r['prompt']) for r in data)}-{max(len(r['prompt']) for r in data)} tokens")
        report(measure(data, args.k), args.k)
        return 0

    tok = AutoTokenizer.from_pretrained(args.model)
    sizes = (500, 700) if args.smoke else spec_class.PROMPT_TOKENS
    calls = spec_class.make_class(args.submissions, args.seed, sizes,
                                  count=lambda text: len(spec_class.chat_ids(tok, text)))
    print(f"class: {args.submissions} submissions, prompts {min(c.prompt_tokens for c in calls)}-"
          f"{max(c.prompt_tokens for c in calls)} tokens, answers up to {args.answer_tokens} tokens, model {args.model}")
    t0 = time.time()
    data = spec_class.answers(calls, args.model, args.answer_tokens, args.cache_dir,
                              progress=lambda s: print(f"  [{time.time() - t0:.0f} s] {s}", flush=True),
                              generate=not args.cached)
    print(f"measured: {len({r['submission'] for r in data})} submissions, {len(data)} answers")
    for row in data[:2]:
        print(f"  {row['role']} answer: {tok.decode(row['answer'])[:160]!r}")
    report(measure(data, args.k), args.k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
