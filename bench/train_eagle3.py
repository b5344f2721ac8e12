"""Train an EAGLE-3 head for smollm2:135m on this CPU from the model's own hidden states over text shipped offline (this
project's docs, the Markdown in installed packages); the head is cached beside the model (models/smollm2-135m-eagle3),
never in the repository. `make draft-head` (python -m bench.train_eagle3); `--smoke`: a few steps, a temporary folder.

Labels are the target's own greedy next tokens (the head learns to predict what verification keeps). Two steps of
EAGLE-3's training-time test: step 1 from the target's fused states, step 2 from the head's own output, attending to
step 1's keys before it and its own key (the attention it meets when drafting the second token).
"""

from __future__ import annotations

import argparse
import glob
import os
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from backends.decode.speculative.eagle3 import Eagle3Config, Eagle3Head, head_config, save_eagle3
from backends.decode.speculative.hidden import HiddenTap, target_args

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "models" / "smollm2-135m-eagle3"


def corpus(tokens: int, tokenizer, seq_len: int) -> np.ndarray:
    """(n, seq_len) token windows from the project's docs, then installed packages' Markdown, in a fixed order."""
    site = Path(np.__file__).resolve().parents[1]
    files = sorted(glob.glob(str(ROOT / "docs" / "*.md"))) + [str(ROOT / "README.md")]
    files += sorted(glob.glob(str(site / "**" / "*.md"), recursive=True))
    ids: list[int] = []
    for f in files:
        try:
            text = Path(f).read_text(errors="ignore")
        except OSError:
            continue
        if len(text) < 2000:
            continue
        ids += tokenizer.encode(text[:40000])
        if len(ids) >= tokens:
            break
    n = min(tokens, len(ids)) // seq_len
    return np.array(ids[:n * seq_len], dtype=np.int32).reshape(n, seq_len)


def target_pass(tap: HiddenTap, windows: np.ndarray, minutes: float, batch: int = 4):
    """The target over the windows, as many as `minutes` allow: (aux states (n, T, 3H) float16, greedy next tokens
    (n, T))."""
    aux, labels = [], []
    t0 = time.time()
    for i in range(0, len(windows), batch):
        x = mx.array(windows[i:i + batch])
        logits, hidden = tap.forward(x, [None] * len(tap.model.layers))
        a, y = hidden.astype(mx.float16), mx.argmax(logits, axis=-1).astype(mx.int32)
        mx.eval(a, y)
        aux.append(np.array(a))
        labels.append(np.array(y))
        done = i + len(x)
        print(f"target pass {done}/{len(windows)} windows, {done * windows.shape[1] / (time.time() - t0):.0f} tok/s",
              flush=True)
        if time.time() - t0 > minutes * 60:
            break
    return np.concatenate(aux), np.concatenate(labels)


def _layer(layer, emb, hidden, offset: int, ctx=None):
    """The head's decoder layer (eagle3.MidLayer) with explicit keys: ctx (keys, values) of step 1 for step 2."""
    attn = layer.self_attn
    x = mx.concatenate([layer.input_layernorm(emb), layer.hidden_norm(hidden)], axis=-1)
    B, L, _ = x.shape
    q = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = attn.rope(q, offset=offset), attn.rope(k, offset=offset)
    if ctx is None:
        keys, values, mask = k, v, "causal"
    else:  # query i (position i + 1) sees step-1 keys 0..i and its own step-2 key
        keys, values = mx.concatenate([ctx[0], k], axis=2), mx.concatenate([ctx[1], v], axis=2)
        i = mx.arange(L)[:, None]
        mask = mx.concatenate([mx.arange(ctx[0].shape[2])[None] <= i, mx.arange(L)[None] == i], axis=1)
    o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
    r = hidden + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
    return r + layer.mlp(layer.post_attention_layernorm(r)), (k, v)


def loss_fn(head: Eagle3Head, emb, aux, y, t2d):
    """emb (B, T, H) of the window's tokens, aux (B, T, 3H), y (B, T) target greedy labels (y[p] predicts x[p+1]),
    t2d: target id -> draft id (-1: outside the draft vocabulary, not counted)."""
    out1, ctx = _layer(head.midlayer, emb[:, 1:], head.fuse(aux[:, :-1]), 0)  # positions 0..T-2: predict y[p+1]
    out2, _ = _layer(head.midlayer, emb[:, 2:], out1[:, :-1], 1, ctx)  # positions 1..T-2: predict y[p+1]
    total = mx.array(0.0)
    hits = []
    for out, labels, w in ((out1, y[:, 1:], 1.0), (out2, y[:, 2:], 0.7)):
        d = t2d[labels]
        logits = head.lm_head(head.norm(out))
        ok = d >= 0
        ce = nn.losses.cross_entropy(logits, mx.maximum(d, 0), reduction="none")
        total = total + w * (ce * ok).sum() / mx.maximum(ok.sum(), 1)
        hits.append(((mx.argmax(logits, axis=-1) == d) * ok).sum() / mx.maximum(ok.sum(), 1))
    return total, hits


def train(args) -> None:
    from mlx_lm import load

    model, tok = load(args.model)
    target = target_args(model)
    cfg = head_config(target, heads=9, kv_heads=3, head_dim=64, intermediate=1536, draft_vocab=args.draft_vocab)
    tap = HiddenTap(model, Eagle3Config.from_dict(cfg).aux_layers(target))
    windows = corpus(args.tokens, tok, args.seq_len)
    print(f"corpus: {windows.size} tokens in {len(windows)} windows of {args.seq_len}", flush=True)
    aux, labels = target_pass(tap, windows, args.pass_minutes)
    windows = windows[:len(aux)]
    counts = np.bincount(labels.ravel(), minlength=target["vocab_size"])
    draft_ids = np.sort(np.argsort(-counts, kind="stable")[:args.draft_vocab])  # the most frequent greedy tokens
    t2d = np.full(target["vocab_size"], -1, dtype=np.int32)
    t2d[draft_ids] = np.arange(len(draft_ids))
    print(f"draft vocabulary {len(draft_ids)} covers {counts[draft_ids].sum() / counts.sum():.3f} of the labels")
    mx.random.seed(0)
    head = Eagle3Head(Eagle3Config.from_dict(cfg))
    head.d2t = mx.array(draft_ids.astype(np.int32) - np.arange(len(draft_ids), dtype=np.int32))
    head.freeze(keys=["d2t"])
    opt = optim.AdamW(learning_rate=optim.join_schedules(
        [optim.linear_schedule(1e-5, args.lr, 50), optim.cosine_decay(args.lr, max(args.steps, 1))], [50]))
    step_fn = nn.value_and_grad(head, loss_fn)
    t2d_mx, rng = mx.array(t2d), np.random.default_rng(0)
    t0, step = time.time(), 0
    while step < args.steps and time.time() - t0 < args.minutes * 60:
        pick = rng.choice(len(windows), size=min(args.batch, len(windows)), replace=False)
        emb = tap.embed(mx.array(windows[pick]))
        (loss, hits), grads = step_fn(head, emb, mx.array(aux[pick]).astype(mx.float32), mx.array(labels[pick]),
                                      t2d_mx)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss, hits)
        step += 1
        if step % 10 == 0 or step == 1:
            print(f"step {step} loss {loss.item():.3f} top-1 step1 {hits[0].item():.3f} step2 {hits[1].item():.3f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    head.unfreeze()
    cfg["_trained"] = {"steps": step, "tokens": int(windows.size), "seconds": round(time.time() - t0),
                       "script": "bench/train_eagle3.py"}
    print(f"saved {save_eagle3(head, cfg, args.out)} after {step} steps")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--tokens", type=int, default=40000, help="corpus tokens (the target pass runs over all of them)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--minutes", type=float, default=20.0, help="training time limit (the target pass not counted)")
    p.add_argument("--pass-minutes", type=float, default=10.0, help="time limit of the target pass (fewer tokens)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="a few steps on a little text into a temporary folder")
    args = p.parse_args()
    if args.smoke:
        import tempfile

        args.tokens, args.steps, args.out = 1024, 3, tempfile.mkdtemp(prefix="eagle3-smoke-")
    os.makedirs(Path(args.out).parent, exist_ok=True)
    train(args)


if __name__ == "__main__":
    main()
