"""The EAGLE-3 head of backends/decode/speculative/eagle3.py in torch, for training on this CPU (torch's matmuls run
about 10x MLX's CPU ones here), with EAGLE-3's training-time test over n draft steps; `to_mlx` hands the trained
weights to the MLX head under the published names (save_eagle3 writes them), so the decode node loads what it drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """mlx-lm llama.Attention's projections over [embedding, fused] (2 x hidden in); RoPE as mlx's non-traditional
    nn.RoPE (rotate halves, base ** (-2i / head_dim))."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, d = cfg["hidden_size"], cfg["head_dim"]
        self.n_heads, self.n_kv, self.d = cfg["num_attention_heads"], cfg["num_key_value_heads"], d
        self.q_proj = nn.Linear(2 * h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.register_buffer("inv_freq", cfg["rope_theta"] ** (-torch.arange(0, d, 2).float() / d), persistent=False)

    def rope(self, x, pos):
        """x (B, H, L, D), pos (L,) absolute positions."""
        f = pos[:, None].float() * self.inv_freq[None]
        cos, sin = f.cos(), f.sin()
        a, b = x[..., :self.d // 2], x[..., self.d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def qkv(self, x, pos):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv, self.d).transpose(1, 2)
        rep = self.n_heads // self.n_kv
        return (self.rope(q, pos), self.rope(k, pos).repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))


class MidLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = Attention(cfg)
        self.mlp = MLP(h, cfg["intermediate_size"])
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)


class Head(nn.Module):
    """fc, midlayer, norm, lm_head: the MLX Eagle3Head's parameters by the same names (norm_before_residual and
    norm_before_fc off, the target's embeddings)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.fc = nn.Linear(3 * cfg["target_hidden_size"], h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)

    def ttt(self, emb, aux, steps: int):
        """EAGLE-3's training-time test over one sequence. emb (1, T, H) embeddings of tokens x[0..T), aux (1, T, 3H).
        Row p (the origin) of step 1 is the head's cache entry at position p from (emb x[p+1], fc(aux[p])); step j's
        row p sits at position p + j - 1 from (emb x[p+j], step j-1's output at p) and attends to step 1's keys
        0..p and to its own origin's keys of steps 2..j (what a chain draft's j-th token sees). Returns per step the
        draft logits (1, T-1, V); row p of step j predicts the target's greedy token y[p + j]."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        n = emb.shape[1] - 1
        pos = torch.arange(n)
        hidden, logits = self.fc(aux[:, :n]), []
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        k1 = v1 = None
        own: list[tuple] = []  # (keys, values) of steps 2..j, one per origin row
        for j in range(1, steps + 1):
            e = F.pad(emb[:, j:], (0, 0, 0, n - emb.shape[1] + j))  # x[p + j]; zeros past the end (not scored)
            x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(hidden)], dim=-1)
            q, k, v = attn.qkv(x, pos + j - 1)
            if j == 1:
                k1, v1 = k, v
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
            else:
                own.append((k, v))
                s = torch.cat([(q @ k1.transpose(-1, -2)) * attn.d ** -0.5 + torch.where(causal, 0.0, -torch.inf)]
                              + [(q * kk).sum(-1, keepdim=True) * attn.d ** -0.5 for kk, _ in own], dim=-1)
                w = s.softmax(-1)
                o = w[..., :n] @ v1 + sum(w[..., n + i:n + i + 1] * vv for i, (_, vv) in enumerate(own))
            r = hidden + attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))
            hidden = r + layer.mlp(layer.post_attention_layernorm(r))
            logits.append(self.lm_head(self.norm(hidden)))
        return logits


def to_mlx(head: Head, cfg: dict, d2t):
    """The MLX Eagle3Head with `head`'s weights (float32) and the d2t offsets (numpy int32)."""
    import mlx.core as mx

    from backends.decode.speculative.eagle3 import Eagle3Config, Eagle3Head

    out = Eagle3Head(Eagle3Config.from_dict(cfg))
    weights = [(k, mx.array(v.detach().float().numpy())) for k, v in head.state_dict().items()]
    out.load_weights(weights + [("d2t", mx.array(d2t))], strict=True)
    mx.eval(out.parameters())
    return out
