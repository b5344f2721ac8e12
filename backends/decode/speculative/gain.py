"""What speculative decoding should gain on the site's Macs (docs/speculative.md, "What the lab should expect"): a
forward's time as a fixed per-forward overhead plus the bytes it reads (weights once, the KV cache once, the experts
its tokens route to), fitted to published decode rates or to step times measured here; the decode speedup at the best
draft length for a given acceptance. Pure Python: `disagg bench grading --predict` uses it."""

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


def read_bytes(shape: Shape, context: int, n: int, repeat: float = 1.0) -> float:
    """Bytes a forward over n tokens reads at `context` tokens of KV (4-bit weights, bf16 KV read once)."""
    weights = shape.dense_params + shape.layers * experts_read(shape, n, repeat) * shape.expert_params
    return weights * BYTES_PER_PARAM + shape.kv_bytes_per_token * context + shape.kv_window_bytes


@dataclass(frozen=True)
class StepFit:
    """A forward's seconds on a Mac: `overhead_s` per forward (kernel launches, synchronisation, sampling: what does
    not scale with bytes) plus the bytes it reads at `bytes_per_s`."""

    overhead_s: float
    bytes_per_s: float


def fit_published(shape: Shape, rates: tuple[tuple[int, float], ...]) -> StepFit:
    """The overhead and bandwidth that reproduce published decode rates ((context, tokens/s), two or more points):
    least squares of 1 / rate = overhead + read_bytes(context, 1) / bandwidth. The rate falling with context sets the
    bandwidth (the KV read grows); what the bytes at that bandwidth do not explain is the per-forward overhead."""
    xs = [read_bytes(shape, c, 1) for c, _ in rates]
    ys = [1.0 / r for _, r in rates]
    if len(xs) < 2 or max(xs) == min(xs):
        raise ValueError("fitting a step needs decode rates at two or more context lengths")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError(f"decode rates {rates} do not fall with context: no bandwidth fits them")
    return StepFit(max(0.0, my - slope * mx), 1.0 / slope)


def forward_cost(shape: Shape, context: int, n: int, repeat: float = 1.0, fit: StepFit | None = None) -> float:
    """A forward over n tokens at `context` tokens of KV, in single-token forwards: with `fit`, overhead + bytes at
    its bandwidth; without, bytes alone (every forward memory-bound, no overhead: the upper bound on its cost)."""
    if fit is None:
        return read_bytes(shape, context, n, repeat) / read_bytes(shape, context, 1, repeat)
    def t(m: int) -> float:
        return fit.overhead_s + read_bytes(shape, context, m, repeat) / fit.bytes_per_s
    return t(n) / t(1)


def verify_cost(shape: Shape, context: int, k: int, repeat: float = 1.0, fit: StepFit | None = None) -> float:
    """Each drafted token's share of a plain step in a verify forward over k + 1 tokens (config's verify_cost)."""
    return (forward_cost(shape, context, k + 1, repeat, fit) - 1) / k


def decode_speedup(shape: Shape, context: int, alpha: float, match: float, max_k: int = 6,
                   repeat: float = 1.0, fit: StepFit | None = None, draft_cost: float = 0.0) -> tuple[int, float]:
    """(best k, decode speedup) for a source that finds a draft on `match` of the steps, each drafted token kept
    with probability alpha until the first refusal; steps without a match are plain; `draft_cost`: drafting's own
    time per step as a share of a plain step. (0, 1.0): none pays."""
    best = (0, 1.0)
    for k in range(1, max_k + 1):
        tokens = match * expected_tokens(alpha, k) + (1 - match)
        cost = match * forward_cost(shape, context, k + 1, repeat, fit) + (1 - match) + draft_cost
        if tokens / cost > best[1]:
            best = (k, tokens / cost)
    return best


def fit_steps(samples: list[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """A machine's measured forwards (rows n, context, seconds) fitted as t = a + b (n - 1) + c context
    + d (n - 1) context (least squares): a + c context is a plain step, b + d context each extra row's price."""
    rows = [(1.0, n - 1.0, float(c), (n - 1.0) * c) for n, c, _ in samples]
    if len(samples) < 4 or len({(n, c) for n, c, _ in samples}) < 4:
        raise ValueError("fitting step times needs four or more distinct (rows, context) samples")
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(4)] for i in range(4)]
    atb = [sum(r[i] * t for r, (_, _, t) in zip(rows, samples)) for i in range(4)]
    return tuple(_solve(ata, atb))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a small, well-posed normal-equation system)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            raise ValueError("step samples do not determine the fit (vary both rows and context)")
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][j] * out[j] for j in range(r + 1, n))) / m[r][r]
    return out
