"""A verify forward's price, measured and fitted: this machine's forwards of 1 and k + 1 rows of SmolLM2-135M at a
few context depths (mlx, in-process), the fit gain.py's `fit_steps` makes of them, and the site models' verify cost at
the fit to their published Mac decode rates (gain.py `fit_published`: per-forward overhead + bytes at a bandwidth).

Run from the repository root:  .venv/bin/python -m bench.bench_step_cost [--depths 256,1024,2048] [--smoke]

The context is random KV of the model's shape (attention costs the same whatever the values); each forward is
trimmed off again, and sizes are interleaved and repeated, the fastest of each kept (the least disturbed on a busy machine).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from backends.decode.speculative.gain import SHAPES, fit_published, fit_steps, read_bytes, verify_cost

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "smollm2-135m"


def _cache(model, depth: int):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    args = model.args
    heads = args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    for c in cache:
        k = mx.random.normal((1, heads, depth, dim)).astype(mx.float32)
        c.state = (k, k * 0.5, depth)  # (keys, values, offset)
    mx.eval([c.state for c in cache])
    return cache


def measure(model, depths: list[int], rows: list[int], reps: int) -> list[tuple[int, int, float]]:
    """(rows, depth, fastest seconds) of each forward size: the least disturbed by other work on the machine."""
    import mlx.core as mx

    times: dict[tuple[int, int], list[float]] = {}
    caches = {d: _cache(model, d) for d in depths}
    for _ in range(reps):
        for d in depths:
            for n in rows:
                x = mx.array([[42 + i for i in range(n)]])
                t0 = time.perf_counter()
                mx.eval(model(x, cache=caches[d]))
                times.setdefault((n, d), []).append(time.perf_counter() - t0)
                for c in caches[d]:
                    c.trim(n)
    return [(n, d, min(v)) for (n, d), v in sorted(times.items())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", default="256,1024,2048,4096")
    ap.add_argument("--max-k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="two depths, three repetitions")
    args = ap.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    if args.smoke:
        depths, args.reps = [64, 256], 3
    from mlx_lm import load

    model, _ = load(str(MODEL_DIR))
    rows = list(range(1, args.max_k + 2))
    samples = measure(model, depths, rows, args.reps)
    a, b, c, d = fit_steps(samples)
    print(f"this machine, SmolLM2-135M float32, {args.reps} repetitions (fastest): forward ms by rows")
    print(f"{'depth':>6} " + " ".join(f"{n:>3} row{'s' if n > 1 else ' '}" for n in rows)
          + "  verify_cost k=1..%d (measured / fitted)" % args.max_k)
    by = {(n, dd): t for n, dd, t in samples}
    for dd in depths:
        plain = by[(1, dd)]
        meas = [(by[(k + 1, dd)] / plain - 1) / k for k in range(1, args.max_k + 1)]
        fitted = [(b + d * dd) / (a + c * dd) for _ in range(1, args.max_k + 1)]
        print(f"{dd:>6} " + " ".join(f"{1e3 * by[(n, dd)]:>8.1f}" for n in rows) + "  "
              + " ".join(f"{m:.2f}/{f:.2f}" for m, f in zip(meas, fitted)))
    print(f"fit: t = {1e3 * a:.2f} ms + {1e3 * b:.2f} ms x (rows - 1) + {1e6 * c:.3f} us x depth "
          f"+ {1e6 * d:.4f} us x (rows - 1) x depth")
    print("\nsite models at the fit to published Mac decode rates (backends/grading/rates.py PUBLISHED_RATES):")
    from backends.grading.rates import PUBLISHED_RATES

    for family, shape in SHAPES.items():
        fit = fit_published(shape, PUBLISHED_RATES[family]["decode"])
        share = fit.overhead_s / (fit.overhead_s + read_bytes(shape, 0, 1) / fit.bytes_per_s)
        costs = " ".join(f"{ctx // 1000}k: " + "/".join(f"{verify_cost(shape, ctx, k, fit=fit):.2f}"
                                                         for k in range(1, args.max_k + 1))
                         for ctx in (6000, 15000, 25000))
        print(f"  {family:9s} overhead {1e3 * fit.overhead_s:.1f} ms ({share:.0%} of a step at 0 context), "
              f"{fit.bytes_per_s / 1e9:.0f} GB/s; verify_cost k=1/2/3 at {costs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
