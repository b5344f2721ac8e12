"""A tiny gpt_oss checkpoint whose greedy output is scripted: harmony reasoning, then the final-channel header.

Weights are set by hand, not trained: one-hot embeddings for the script's tokens, an lm_head that maps each to its
successor (a bigram), and one attention head that lights a feature once the reasoning word has been said, which
turns the second `<|channel|>` from "analysis" into "final". Experts and the other heads are zero. Used where a
test needs gpt-oss's shape of output (reasoning before an answer) from a real decode node.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests.support.tiny_models import build_family

# After the prompt's `<|start|>assistant`: <|channel|>analysis<|message|> ponder deeply<|end|><|start|>assistant
# <|channel|>final<|message|>, then whatever the request's grammar allows ('}' is the likeliest closing token).
REASONING = " ponder deeply"
SIGNAL = 127  # the hidden dimension the attention head writes once " ponder" is in the context


def _ids(folder: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    one = {s: tok.encode(s, add_special_tokens=False).ids for s in
           ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "analysis", "final", " ponder", " deeply", "}",
            "assistant")}
    assert all(len(v) == 1 for k, v in one.items() if k != "assistant"), one
    out = {k: v[0] for k, v in one.items() if k != "assistant"}
    out["ass"], out["istant"] = one["assistant"]
    return out


def build_scripted_gpt_oss(folder: Path, big: float = 10.0) -> Path:
    """The tiny gpt_oss family checkpoint (tests/support/tiny_models.py) with the scripted weights."""
    build_family("gpt_oss", folder)
    config = json.loads((folder / "config.json").read_text())
    hidden, hd = config["hidden_size"], config["head_dim"]
    t = load_file(str(folder / "model.safetensors"))
    ids = _ids(folder)
    chain = ["<|start|>", "ass", "istant", "<|channel|>", "analysis", "final", "<|message|>", " ponder", " deeply",
             "<|end|>"]
    dim = {name: i for i, name in enumerate(chain)}
    succ = {"<|start|>": "ass", "ass": "istant", "istant": "<|channel|>", "<|channel|>": "analysis",
            "analysis": "<|message|>", "final": "<|message|>", "<|message|>": " ponder", " ponder": " deeply",
            " deeply": "<|end|>", "<|end|>": "<|start|>"}
    for name, x in t.items():  # everything off: the script below is the whole model
        if name.endswith("_scales"):
            t[name] = np.full_like(x, 127)
        elif name.endswith("norm.weight"):
            t[name] = np.ones_like(x)
        else:
            t[name] = np.zeros_like(x)
    emb, head = t["model.embed_tokens.weight"], t["lm_head.weight"]
    for name, d in dim.items():
        emb[ids[name], d] = 1.0
    for a, b in succ.items():
        head[ids[b], dim[a]] += big
    # After " ponder" the signal is about sqrt(hidden) while the token's own part shrinks to about 1 (RMSNorm):
    # "final" then beats "analysis" after <|channel|> and still loses to every other successor.
    head[ids["final"], dim["<|channel|>"]] = big / 2
    head[ids["final"], SIGNAL] = 0.66 * big / hidden ** 0.5
    head[ids["}"], SIGNAL] = 0.3 * big / hidden ** 0.5
    p = "model.layers.1.self_attn"  # a full-attention layer: the signal must reach back over the whole output
    for d in (hd // 2 - 1, hd - 1):  # the slowest-rotating rope dims: the score barely depends on distance
        t[f"{p}.q_proj.bias"][d] = 5.0
        t[f"{p}.k_proj.weight"][d, dim[" ponder"]] = 5.0
    t[f"{p}.v_proj.weight"][0, dim[" ponder"]] = 1.0
    t[f"{p}.o_proj.weight"][SIGNAL, 0] = 1.0
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
