"""Constrained decoding: llguidance vs xgrammar (mask cost per token at batch 1 and 8, 50-property schema compile),
and decode tokens/s of the embedded model with a JSON-schema constraint vs the same requests unconstrained.

Run from the repository root:  .venv/bin/python -m bench.bench_grammar [--max-tokens 64] [--repeats 3]
Engines are driven over a fixed valid JSON document (mask, then consume its next token). Decode runs mlx-lm's
BatchGenerator directly, as the decode node does, greedy; ratios are against the unconstrained run of this process.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from backends.decode.grammar import GrammarCompiler, GrammarSpec

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "smollm2-135m"
TYPES = [{"type": "string", "maxLength": 16}, {"type": "integer"}, {"type": "boolean"},
         {"type": "array", "items": {"type": "number"}, "maxItems": 3}, {"enum": ["a", "b", "c"]}]
VALUES = ["text", 42, True, [1.5, 2], "b"]
SMALL = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
         "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                        "city": {"type": "string", "maxLength": 20}}}
PROMPTS = ["Describe a student as JSON.", "Describe a teacher as JSON.", "Describe a pilot as JSON.",
           "Describe a baker as JSON.", "Describe a poet as JSON.", "Describe a nurse as JSON.",
           "Describe a farmer as JSON.", "Describe a chef as JSON."]


def big_schema(n: int = 50) -> tuple[dict, dict]:
    """A flat n-property schema (all required, no extras) and a document valid for it."""
    props = {f"field_{i}": TYPES[i % len(TYPES)] for i in range(n)}
    doc = {f"field_{i}": VALUES[i % len(VALUES)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}, doc


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_llguidance(hf, schema, tokens, vocab, eos, batch, repeats) -> tuple[float, float]:
    """(compile seconds, mask seconds per token per row) for llguidance."""
    import llguidance
    import llguidance.hf

    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    compile_s = timed(lambda: llguidance.LLMatcher(
        tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=opts)), repeats)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=opts)
    bits = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)

    def run():
        ms = [llguidance.LLMatcher(tok, grammar) for _ in range(batch)]
        t = time.perf_counter()
        for token in tokens:
            for i, m in enumerate(ms):
                m.unsafe_compute_mask_ptr(bits[i].ctypes.data, bits[i].nbytes)
                assert m.consume_token(token), m.get_error()
        return time.perf_counter() - t
    return compile_s, min(run() for _ in range(repeats)) / len(tokens) / batch


def bench_xgrammar(hf, schema, tokens, vocab, eos, batch, repeats) -> tuple[float, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)

    def compile_once():  # a fresh compiler each time: its cache would make repeats free
        return xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    compile_s = timed(compile_once, repeats)
    compiled = compile_once()
    bits = xgr.allocate_token_bitmask(batch, vocab)

    def run():
        ms = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        t = time.perf_counter()
        for token in tokens:
            for i, m in enumerate(ms):
                m.fill_next_token_bitmask(bits, i)
                assert m.accept_token(token)
        return time.perf_counter() - t
    return compile_s, min(run() for _ in range(repeats)) / len(tokens) / batch


def engines(args) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    schema, doc = big_schema()
    tokens = hf.encode(json.dumps(doc), add_special_tokens=False)
    print(f"engines: 50-property schema, document of {len(tokens)} tokens, vocab 49152")
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        for batch in (1, 8):
            compile_s, per = fn(hf, schema, tokens, 49152, [2], batch, args.repeats)
            print(f"  {name:10s} batch {batch}: compile {compile_s * 1e3:7.2f} ms   mask+consume "
                  f"{per * 1e6:7.1f} us/token/row")


def decode_rate(model, tok, prompts, processors, max_tokens) -> tuple[int, float]:
    """(tokens generated, seconds) for one greedy BatchGenerator run, counted from the first token on: prefill
    is the same work in both conditions and would hide the decode cost."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[[t] for t in tok.eos_token_ids], completion_batch_size=len(prompts))
    gen.insert(prompts, max_tokens=[max_tokens] * len(prompts), logits_processors=processors)
    n, left, t = 0, len(prompts), None
    while left:
        _, responses = gen.next()
        if responses and t is None:
            t = time.perf_counter()
        elif t is not None:
            n += len(responses)
        left -= sum(r.finish_reason is not None for r in responses)
    seconds = time.perf_counter() - t
    gen.close()
    return n, seconds


def decode(args) -> None:
    from mlx_lm import load

    model, tok = load(str(MODEL_DIR))
    t = time.perf_counter()
    compiler = GrammarCompiler(tok._tokenizer, model.args.vocab_size, list(tok.eos_token_ids))
    print(f"decode: tokenizer for llguidance built in {time.perf_counter() - t:.2f} s (once per model)")
    spec = GrammarSpec(schema=SMALL, strict=True)
    for batch in (1, 8):
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p in PROMPTS[:batch]]
        rates = {}
        for _ in range(args.repeats):  # alternate, so drift in machine load hits both alike
            for name in ("free", "json_schema"):
                procs = [[compiler.processor(spec)] if name == "json_schema" else [] for _ in prompts]
                n, s = decode_rate(model, tok, prompts, procs, args.max_tokens)
                rates[name] = max(rates.get(name, 0.0), n / s)
        print(f"  batch {batch}: free {rates['free']:6.1f} tok/s   json_schema {rates['json_schema']:6.1f} tok/s   "
              f"ratio {rates['json_schema'] / rates['free']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = ap.parse_args()
    if args.smoke:
        args.max_tokens, args.repeats = 8, 1
    engines(args)
    if not args.skip_decode:
        decode(args)


if __name__ == "__main__":
    main()
