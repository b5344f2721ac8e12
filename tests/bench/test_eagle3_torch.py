"""The trainer's torch head (bench/eagle3_torch.py) computes what the decode node's MLX head drafts: its training-time
test's step j at an origin equals the MLX head's j-th chain draft there (Eagle3Source's way: the cache of step 1's
rows, then the head's own output fed back), so a head is trained for the attention it meets when drafting."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch
from mlx_lm.models.cache import KVCache

from backends.decode.speculative.eagle3 import head_config
from bench.eagle3_torch import Head, to_mlx


def test_training_time_test_equals_the_mlx_heads_chain_drafts():
    target = {"hidden_size": 64, "vocab_size": 300, "num_hidden_layers": 6, "rope_theta": 10000.0,
              "rope_scaling": None}
    cfg = head_config(target, heads=4, kv_heads=2, head_dim=16, intermediate=96, draft_vocab=50)
    torch.manual_seed(0)
    head = Head(cfg)
    with torch.no_grad():  # norms away from 1, so a misplaced norm shows
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mlx_head = to_mlx(head, cfg, np.arange(50, dtype=np.int32))
    rng = np.random.default_rng(0)
    T, origin = 24, 15
    emb = rng.standard_normal((T, 64)).astype(np.float32)
    aux = rng.standard_normal((T, 3 * 64)).astype(np.float32)
    with torch.no_grad():
        steps = [s[0].numpy() for s in head.ttt(torch.tensor(emb)[None], torch.tensor(aux)[None], 3)]
    cache = [KVCache()]  # rows 0..origin from the target's states, as the source consumes them
    out, logits = mlx_head(mx.array(emb[1:origin + 2])[None], mlx_head.fuse(mx.array(aux[:origin + 1])[None]), cache)
    np.testing.assert_allclose(np.array(logits[0]), steps[0][:origin + 1], atol=1e-4)
    out = out[:, -1:]
    for j in (2, 3):  # the chain: the token x[origin + j] and the head's own output
        out, logits = mlx_head(mx.array(emb[origin + j:origin + j + 1])[None], out, cache)
        np.testing.assert_allclose(np.array(logits[0, -1]), steps[j - 1][origin], atol=1e-4)
