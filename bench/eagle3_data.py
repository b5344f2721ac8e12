"""Self-distillation data for the EAGLE-3 head (bench/train_eagle3.py): prompts like the site's (short prose answers and
feedback, a rubric + a student's notebook), the target's own greedy answers to them (torch, cached), and the target's
states at the head's layers with its greedy next tokens over prompt + answer: what the head drafts on, as EAGLE does.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

import numpy as np

from backends.grading import spec_class

# Never trained on: bench/bench_learned.py's prose prompts, nor any prompt on their subjects (`near_held_out`), and
# the class replay's own class (make_class's seed 0): the grading prompts here draw notebooks from GRADING_SEED on.
GRADING_SEED = 1000
HELD_OUT_SUBJECTS = ("sky", "water cycle", "compiler", "exercise")
_TOPICS = ["rain forms", "a bicycle's gears work", "bread rises", "the moon has phases", "a vaccine trains the body",
           "interest on a loan grows", "a refrigerator keeps food cold", "plants make sugar from light",
           "volcanoes erupt", "a battery stores energy", "an election counts votes", "bees make honey",
           "a river shapes its valley", "a microwave heats food", "a rainbow forms", "tides rise and fall",
           "a thermostat controls heat", "a bridge carries a load", "the heart pumps blood", "a search engine ranks pages",
           "a spreadsheet recalculates", "a compass finds north", "coffee keeps people awake", "earthquakes happen",
           "a camera records an image", "a library organises books", "recycling saves resources",
           "a database answers a query", "a budget helps a household", "a histogram summarises data"]
_ASKS = ["Explain in a few sentences how {t}.", "Describe, for a curious child, how {t}.",
         "In one paragraph, explain why it matters how {t}.", "Write a short explanation of how {t}."]
_WORK = ["essay", "lab report", "presentation", "notebook", "poster", "short story", "data analysis", "book review"]
_SUBJECTS = ["the water cycle", "climate change", "the French revolution", "linear regression", "volcanoes",
             "healthy eating", "the solar system", "a local election", "photosynthesis", "the stock market",
             "recycling", "the human heart"]
_QUALITY = ["clear but too short", "well researched but hard to follow", "creative but missing sources",
            "accurate but full of spelling mistakes", "thorough but late", "confident but with a wrong conclusion"]


def prompts(n_prose: int, n_grading: int, seed: int = 0) -> list[dict]:
    """Chat prompts as dicts {kind, text}: prose questions and feedback requests, then rubric + notebook prompts
    (prose feedback, and some JSON analyses as the class's other lane). Fixed by `seed`."""
    from bench.bench_learned import PROSE

    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n_prose:
        if rng.random() < 0.5:
            text = rng.choice(_ASKS).format(t=rng.choice(_TOPICS))
        else:
            text = (f"Write a short paragraph of feedback for a student whose {rng.choice(_WORK)} on "
                    f"{rng.choice(_SUBJECTS)} was {rng.choice(_QUALITY)}.")
        if text not in PROSE and text not in {p["text"] for p in out}:
            out.append({"kind": "prose", "text": text})
    for i in range(n_grading):
        nb = spec_class._notebook(random.Random(GRADING_SEED + seed * 10007 + i), rng.randint(900, 2400))
        role = "analysis" if i % 4 == 3 else "feedback"
        out.append({"kind": role, "text": spec_class.prompt(role, nb)})
    return out


def near_held_out(text: str) -> bool:
    """A prose prompt on the subject of one of bench_learned's (the grading prompts share only the rubric)."""
    return not text.startswith(spec_class.RUBRIC) and any(w in text.lower() for w in HELD_OUT_SUBJECTS)


def _batches(ids: list[list[int]], size: int):
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # like lengths together: little padding
    for i in range(0, len(order), size):
        yield order[i:i + size]


def generate(model, tok, items: list[dict], max_tokens: int, batch: int, log=print) -> list[dict]:
    """Each prompt's chat ids and the target's greedy answer (torch, left-padded batches; the labels are recomputed
    unpadded by `target_states`, so a padding rounding difference never reaches them)."""
    import torch

    ids = [spec_class.chat_ids(tok, it["text"]) for it in items]
    rows: list[dict | None] = [None] * len(ids)
    pad, t0, done = tok.pad_token_id if tok.pad_token_id is not None else 0, time.time(), 0
    for pick in _batches(ids, batch):
        width = max(len(ids[i]) for i in pick)
        x = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in pick])
        mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in pick])
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=pad)
        for row, i in zip(out[:, width:].tolist(), pick):
            answer = []
            for t in row:
                if t in (tok.eos_token_id, pad):
                    break
                answer.append(t)
            rows[i] = {**items[i], "prompt": ids[i], "answer": answer}
        done += len(pick)
        log(f"generated {done}/{len(ids)} answers ({time.time() - t0:.0f} s)")
    return rows  # type: ignore[return-value]


def cached_answers(model_path: str, items: list[dict], max_tokens: int, batch: int, cache_dir: Path,
                   log=print) -> list[dict]:
    """`generate`'s rows, cached in `cache_dir` by prompts, model and length (a rerun trains without generating)."""
    key = hashlib.sha256(json.dumps(items).encode())
    key.update(f"{Path(model_path).resolve()}|{max_tokens}".encode())
    path = Path(cache_dir) / f"distill-{key.hexdigest()[:16]}.json"
    if path.exists():
        return json.loads(path.read_text())
    model, tok = load_torch(model_path)
    rows = generate(model, tok, items, max_tokens, batch, log)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))
    return rows


def load_torch(model_path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_path)


def target_states(model, rows: list[dict], layers: list[int], context: int, batch: int = 2, log=print) -> list[dict]:
    """Per row, prompt + answer cut to the last `context` prompt tokens: tokens (T,), the states at `layers` (HF's
    hidden_states indices, as HiddenTap's points) (T, len(layers) * H) float16, the target's greedy next token at each
    position (T,), and `start`, the first answer position. Right-padded batches: causal, so padding changes nothing."""
    import torch

    seqs = [r["prompt"] + r["answer"] for r in rows]
    out: list[dict | None] = [None] * len(rows)
    t0, done = time.time(), 0
    for pick in _batches(seqs, batch):
        width = max(len(seqs[i]) for i in pick)
        x = torch.tensor([seqs[i] + [0] * (width - len(seqs[i])) for i in pick])
        with torch.no_grad():  # the base model, then the logits a chunk at a time: (B, T, 49152) float32 is GBs
            o = model.model(x, output_hidden_states=True)
            head = model.get_output_embeddings()
            greedy = torch.cat([head(h).argmax(-1) for h in o.last_hidden_state.split(256, dim=1)], dim=1)
        aux = torch.cat([o.hidden_states[p] for p in layers], dim=-1).half().numpy()
        greedy = greedy.numpy().astype(np.int32)
        for j, i in enumerate(pick):
            start, end = len(rows[i]["prompt"]), len(seqs[i])
            lo = max(0, start - context)
            out[i] = {"tokens": np.array(seqs[i][lo:end], dtype=np.int32), "aux": aux[j, lo:end],
                      "greedy": greedy[j, lo:end], "start": start - lo, "kind": rows[i]["kind"]}
        done += len(pick)
        log(f"target pass {done}/{len(seqs)} sequences ({time.time() - t0:.0f} s)")
    return out  # type: ignore[return-value]
