"""Train an EAGLE-3 head for smollm2:135m on this CPU by self-distillation, EAGLE's practice: the target answers prompts
like the site's greedily (bench/eagle3_data.py, cached under .disagg/eagle3-distill), and the head learns, over n steps
of the training-time test, to predict the target's greedy tokens of those answers from its own states. Torch trains
(bench/eagle3_torch.py); the MLX head is written where the decode node loads it (models/smollm2-135m-eagle3).

`make draft-head` (python -m bench.train_eagle3); `--smoke`: 4 short answers, a few steps, a temporary folder.
Every `--val-every`-th prompt is held out: the head's agreement with the target on it, per draft position, is printed
and written into the head's config.json (`_trained.heldout_top1`).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "models" / "smollm2-135m-eagle3"


def draft_vocab(train: list[dict], vocab: int, size: int):
    """(draft ids: the `size` most frequent greedy tokens of the answers, then of the prompts, sorted; t2d: target id
    -> draft id or -1; the share of the answers' tokens the draft ids cover)."""
    counts, prompt = np.zeros(vocab, dtype=np.int64), np.zeros(vocab, dtype=np.int64)
    for s in train:
        np.add.at(counts, s["greedy"][s["start"]:], 1)
        np.add.at(prompt, s["greedy"][:s["start"]], 1)
    ids = np.sort(np.lexsort((-prompt, -counts))[:size])  # answers first; the prompts' tokens fill the rest
    t2d = np.full(vocab, -1, dtype=np.int64)
    t2d[ids] = np.arange(len(ids))
    return ids, t2d, counts[ids].sum() / max(counts.sum(), 1)


def step_loss(head, embed, s: dict, t2d, steps: int, decay: float = 0.8):
    """(loss, per step (hits, counted)) of one sequence: draft position j's rows are scored where the label y[p + j]
    lies in the answer and in the draft vocabulary; EAGLE-3's weight decay ** (j - 1)."""
    import torch
    import torch.nn.functional as F

    toks = torch.from_numpy(s["tokens"].astype(np.int64))
    with torch.no_grad():
        emb = embed(toks)[None]
    logits = head.ttt(emb, torch.from_numpy(s["aux"]).float()[None], steps)
    y, n = torch.from_numpy(t2d[s["greedy"]]), len(toks) - 1
    total, stats = 0.0, []
    for j, lg in enumerate(logits, 1):
        q = torch.arange(n) + j  # the label index of each row
        lab = y[q.clamp(max=n)]
        scored = (q <= n) & (q >= s["start"])
        ok = scored & (lab >= 0)  # a label outside the draft vocabulary: no loss, and a miss in the agreement
        if ok.any():
            total = total + decay ** (j - 1) * F.cross_entropy(lg[0][ok], lab[ok])
        stats.append((int((lg[0].argmax(-1) == lab)[ok].sum()), int(scored.sum())))
    return total, stats


def evaluate(head, embed, seqs: list[dict], t2d, steps: int) -> list[float]:
    """Top-1 agreement with the target's greedy token per draft position over `seqs` (teacher-forced: position j
    given the j - 1 before it right, i.e. given that they were accepted)."""
    import torch

    hits, n = np.zeros(steps), np.zeros(steps)
    with torch.no_grad():
        for s in seqs:
            _, st = step_loss(head, embed, s, t2d, steps)
            hits += [h for h, _ in st]
            n += [c for _, c in st]
    return [round(float(h / max(c, 1)), 3) for h, c in zip(hits, n)]


def new_head(cfg: dict, target, ids):
    """A head whose lm_head and norm start as the target's own over the draft vocabulary (tied embeddings)."""
    import torch

    from bench.eagle3_torch import Head

    torch.manual_seed(0)
    head = Head(cfg)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[torch.from_numpy(ids)])
        head.norm.weight.copy_(target.model.norm.weight)
    return head


def fit(head, embed, train: list[dict], val: list[dict], t2d, args) -> int:
    """AdamW, linear warm-up then a cosine over the time budget; one sequence a step. Returns the steps taken."""
    import torch

    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    rng, t0, step = np.random.default_rng(0), time.time(), 0
    budget = args.minutes * 60
    while step < args.max_steps and time.time() - t0 < budget:
        for i in rng.permutation(len(train)):
            frac = min(1.0, (time.time() - t0) / budget)
            lr = args.lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * frac))
            for g in opt.param_groups:
                g["lr"] = lr
            loss, st = step_loss(head, embed, train[i], t2d, args.ttt_steps)
            if not torch.is_tensor(loss):
                continue
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 50 == 0 or step == 1:
                acc = " ".join(f"{h / max(c, 1):.2f}" for h, c in st)
                print(f"step {step} loss {loss.item():.3f} top-1 per position {acc} lr {lr:.2e} "
                      f"({time.time() - t0:.0f} s)", flush=True)
            if step % args.eval_every == 0:
                print(f"held-out top-1 per position {evaluate(head, embed, val, t2d, args.ttt_steps)}", flush=True)
            if step >= args.max_steps or time.time() - t0 >= budget:
                break
    return step


def train(args) -> None:
    import torch

    from backends.decode.speculative.eagle3 import head_config, save_eagle3
    from bench import eagle3_data
    from bench.eagle3_torch import to_mlx

    torch.set_num_threads(args.threads)  # 2 threads on 2 shared cores thrash (20x slower steps measured)
    t_start = time.time()
    items = eagle3_data.prompts(args.prose, args.grading)
    rows = eagle3_data.cached_answers(args.model, items, args.max_tokens, args.gen_batch, Path(args.cache_dir))
    rows = [r for r in rows if not eagle3_data.near_held_out(r["text"])]
    print(f"{len(rows)} answers, {sum(len(r['answer']) for r in rows)} tokens ({time.time() - t_start:.0f} s)")
    target, _ = eagle3_data.load_torch(args.model)
    tc = target.config
    tgt = {"hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size, "num_hidden_layers": tc.num_hidden_layers,
           "rope_theta": float(getattr(tc, "rope_theta", None) or tc.rope_parameters["rope_theta"]),
           "rope_scaling": None}
    cfg = head_config(tgt, heads=9, kv_heads=3, head_dim=64, intermediate=1536, draft_vocab=args.draft_vocab)
    data = eagle3_data.target_states(target, rows, cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                                     args.context)
    agree = np.mean(np.concatenate([s["greedy"][s["start"] - 1:-1] == s["tokens"][s["start"]:] for s in data]))
    print(f"answers equal the unpadded greedy target on {agree:.3f} of their tokens ({time.time() - t_start:.0f} s)")
    val = [s for i, s in enumerate(data) if i % args.val_every == 0]
    train_set = [s for i, s in enumerate(data) if i % args.val_every]
    ids, t2d, cover = draft_vocab(train_set, tc.vocab_size, args.draft_vocab)
    print(f"draft vocabulary {len(ids)} covers {cover:.3f} of the training answers' tokens; {len(train_set)} "
          f"sequences to train on, {len(val)} held out")
    head, embed = new_head(cfg, target, ids), target.get_input_embeddings()
    before = evaluate(head, embed, val, t2d, args.ttt_steps)
    t_fit = time.time()
    steps = fit(head, embed, train_set, val, t2d, args)
    fit_s = time.time() - t_fit
    after = evaluate(head, embed, val, t2d, args.ttt_steps)
    print(f"held-out top-1 per position: {before} untrained, {after} after {steps} steps ({fit_s:.0f} s)")
    cfg["_trained"] = {"steps": steps, "sequences": len(train_set), "answer_tokens": int(
        sum(len(s["tokens"]) - s["start"] for s in train_set)), "train_seconds": round(fit_s),
        "wall_seconds": round(time.time() - t_start), "ttt_steps": args.ttt_steps, "heldout_top1": after,
        "script": "bench/train_eagle3.py (self-distillation)"}
    d2t = (ids - np.arange(len(ids))).astype(np.int32)
    print(f"saved {save_eagle3(to_mlx(head, cfg, d2t), cfg, args.out)}; wall {time.time() - t_start:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--cache-dir", default=str(ROOT / ".disagg" / "eagle3-distill"), help="the generated answers")
    p.add_argument("--prose", type=int, default=64, help="short prose prompts (questions, feedback requests)")
    p.add_argument("--grading", type=int, default=48, help="rubric + notebook prompts (3 of 4 prose feedback)")
    p.add_argument("--max-tokens", type=int, default=192, help="answer tokens generated per prompt")
    p.add_argument("--gen-batch", type=int, default=16)
    p.add_argument("--context", type=int, default=512, help="prompt tokens kept before each answer")
    p.add_argument("--ttt-steps", type=int, default=3, help="draft positions trained (the decode node's k)")
    p.add_argument("--minutes", type=float, default=12.0, help="training time (generation and target pass apart)")
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--eval-every", type=int, default=400)
    p.add_argument("--val-every", type=int, default=8, help="every n-th prompt is held out")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="4 short answers, a few steps, into a temporary folder")
    args = p.parse_args()
    if args.smoke:
        import tempfile

        tmp = tempfile.mkdtemp(prefix="eagle3-smoke-")
        args.prose, args.grading, args.max_tokens, args.max_steps, args.val_every = 3, 1, 16, 4, 2
        args.out, args.cache_dir, args.eval_every, args.draft_vocab = tmp, tmp, 2, 256
    os.makedirs(Path(args.out).parent, exist_ok=True)
    train(args)


if __name__ == "__main__":
    main()
