"""What speculative decoding should gain on the site's Macs (docs/speculative.md, "What the lab should expect"): a
verify forward's cost from what it reads (weights once, the KV cache once, the experts its tokens route to), and the
decode speedup at the best draft length for a given acceptance. Pure Python: `disagg bench grading --predict` uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.decode.speculative.control import expected_tokens

BYTES_PER_PARAM = 4.5 / 8  # MLX 4-bit, group 64: 4 bits + a 16-bit scale and bias per 64 weights


@dataclass(frozen=True)
class Shape:
    """A site model's per-token reads, from its config.json (sources in SHAPES)."""

    dense_params: float      # read once per forward whatever its tokens: attention, router, lm_head
    expert_params: float     # one expert of one layer (gate, up, down)
    layers: int
    experts: int
    top_k: int
    kv_bytes_per_token: float  # what attention reads per context token (bf16), sliding layers counted apart
    kv_window_bytes: float = 0.0  # sliding layers: read at most their window


# Qwen3-Coder-30B-A3B (config.json): 48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128 experts top 8, moe
# intermediate 768, vocab 151,936 untied. Attention 48 x 18.9M, lm_head 311M, router 48 x 262k: 1.23B dense.
# gpt-oss-120b (config.json): 36 layers, hidden 2880, 64 q / 8 kv heads of 64, 128 experts top 4, intermediate
# 2880, vocab 201,088; half the layers slide over 128 tokens. Attention 36 x 26.5M, lm_head 579M: 1.53B dense;
# with 36 x 4 x 24.9M experts that is the published 5.1B active.
SHAPES = {
    "qwen3_moe": Shape(1.23e9, 3 * 2048 * 768, 48, 128, 8, 48 * 4 * 128 * 2 * 2),
    "gpt_oss": Shape(1.53e9, 3 * 2880 * 2880, 36, 128, 4, 18 * 8 * 64 * 2 * 2, 18 * 8 * 64 * 2 * 2 * 128),
}


def experts_read(shape: Shape, n: int, repeat: float = 1.0) -> float:
    """Experts one layer reads for n consecutive tokens. repeat = 1: independent routing, E (1 - (1 - t/E)^n), an
    upper bound; repeat > 1: each token shares its predecessor's experts `repeat` times as often as chance (Mixtral
    measured about 2x chance for its first choice at deeper layers: Jiang et al. 2024, "Mixtral of Experts", sec. 5)."""
    t, e = shape.top_k, shape.experts
    if repeat <= 1.0:
        return e * (1 - (1 - t / e) ** n)
    shared = min(1.0, repeat * t / e)  # share of a token's experts its predecessor also used
    return min(float(e), t + (n - 1) * t * (1 - shared))


def forward_cost(shape: Shape, context: int, n: int, repeat: float = 1.0) -> float:
    """A forward over n tokens at `context` tokens of KV, in single-token forwards (memory-bound: bytes read)."""
    def read(m: int) -> float:
        weights = (shape.dense_params + shape.layers * experts_read(shape, m, repeat) * shape.expert_params)
        kv = shape.kv_bytes_per_token * context + shape.kv_window_bytes
        return weights * BYTES_PER_PARAM + kv
    return read(n) / read(1)


def verify_cost(shape: Shape, context: int, k: int, repeat: float = 1.0) -> float:
    """Each drafted token's share of a plain step in a verify forward over k + 1 tokens (config's verify_cost)."""
    return (forward_cost(shape, context, k + 1, repeat) - 1) / k


def decode_speedup(shape: Shape, context: int, alpha: float, match: float, max_k: int = 6,
                   repeat: float = 1.0) -> tuple[int, float]:
    """(best k, decode speedup) for prompt lookup that finds a draft on `match` of the steps, each drafted token
    kept with probability alpha until the first refusal; steps without a match are plain. (0, 1.0): none pays."""
    best = (0, 1.0)
    for k in range(1, max_k + 1):
        tokens = match * expected_tokens(alpha, k) + (1 - match)
        cost = match * forward_cost(shape, context, k + 1, repeat) + (1 - match)
        if tokens / cost > best[1]:
            best = (k, tokens / cost)
    return best
