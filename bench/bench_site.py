"""The grading workload on the site (`make site`, examples/site-local.toml): per prompt size, one grading request per
model at once (Ollama /api/generate, format json), split through the gateway, against the local path (a Mac
prefilling itself: its /v1/generate without KV) and vLLM alone (the model's Spark: its /v1/generate), same tokens and
JSON schema, as many generated tokens (vLLM alone: no grammar, max_tokens = the split's count), same run.

Run from the repository root, under the heavy lock:
    flock /tmp/disagg-heavy.lock .venv/bin/python -m bench.bench_site [--cells 5,20,40] [--num-predict 32]
        [--local-max-cells 5] [--plot bench_site.png] [--json F] [--running]
It starts the site (`python -m backends.site.launch`) and stops it after, unless --running (a `make site` already up).
The local path runs only up to --local-max-cells (mlx-cpu was the slow part: ~16 tokens/s of prefill before it ran on
OpenBLAS, backends/host_blas.py; ~240 since).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.support.seed_site import CONFIG, GATEWAY, OSS, SMOL, VERDICT, Site, notebook

from kv_bridge.protocol import json_grammar

TIMEOUT = httpx.Timeout(900.0, connect=30.0)


class Bench:
    def __init__(self, settings, num_predict: int):
        from gateway.text.tokenizer import ChatTokenizer
        from kv_bridge.config.models import resolve_model_path

        self.settings, self.num_predict = settings, num_predict
        self.key = settings.auth.client_keys()[0]
        self.node = {"Authorization": f"Bearer {settings.auth.node_token()}"}
        self.tok = {m.id: ChatTokenizer.from_folder(resolve_model_path(m)) for m in settings.models}
        self.http = httpx.Client(timeout=TIMEOUT)
        self.generated: dict[str, int] = {}  # per model: tokens its last split answer had (the others make as many)

    def split(self, model: str, prompt: str) -> dict:
        t0 = time.perf_counter()
        r = self.http.post(GATEWAY + "/api/generate", headers={"Authorization": f"Bearer {self.key}"},
                           json={"model": model, "prompt": prompt, "stream": False, "format": VERDICT,
                                 "options": {"num_predict": self.num_predict, "temperature": 0.2, "top_p": 0.9}})
        body = r.json()
        if r.status_code != 200:
            raise RuntimeError(f"gateway {r.status_code}: {body}")
        self.generated[model] = body["eval_count"]
        return {"seconds": time.perf_counter() - t0, "ttft": body["prompt_eval_duration"] / 1e9,
                "tokens": body["prompt_eval_count"], "path": r.headers["x-disagg-path"],
                "node": r.headers["x-disagg-decode-node"]}

    def _ids(self, model: str, prompt: str) -> list[int]:
        return self.tok[model].encode_chat([{"role": "user", "content": prompt}])

    def local(self, model: str, prompt: str) -> dict:
        """A Mac prefilling the prompt itself: its /v1/generate with no KV (streamed token lines, then done)."""
        mac = self.settings.node(self.settings.route(model).decode[0])
        body = {"model": model, "token_ids": self._ids(model, prompt), "max_tokens": self.num_predict,
                "temperature": 0.2, "top_p": 0.9, "grammar": json_grammar(VERDICT)}
        t0, ttft = time.perf_counter(), None
        with self.http.stream("POST", mac.url + "/v1/generate", headers=self.node, json=body) as r:
            for line in r.iter_lines():
                if ttft is None and '"token_id"' in line:
                    ttft = time.perf_counter() - t0
        return {"seconds": time.perf_counter() - t0, "ttft": ttft, "tokens": len(body["token_ids"]), "path": "local"}

    def vllm(self, model: str, prompt: str) -> dict:
        """vLLM alone on the model's Spark, the same tokens and max_tokens (no transfer, no MLX)."""
        spark = self.settings.node(self.settings.route(model).prefill[0])
        body = {"model": model, "token_ids": self._ids(model, prompt), "temperature": 0.0,
                "max_tokens": self.generated.get(model, self.num_predict)}  # vLLM alone has no grammar here
        t0 = time.perf_counter()
        r = self.http.post(spark.url + "/v1/generate", headers=self.node, json=body)
        r.raise_for_status()
        return {"seconds": time.perf_counter() - t0, "ttft": None, "tokens": len(body["token_ids"]),
                "path": "vllm-alone"}

    def round(self, how: str, cells: int, tag: str) -> dict:
        """Both models at once, as the lab's app sends them; wall time of the pair and each request's numbers."""
        fn = getattr(self, how.replace("-alone", ""))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda m: fn(m, notebook(cells, f"{tag}-{how}-{m}")), (SMOL, OSS)))
        return {"how": how, "cells": cells, "wall": time.perf_counter() - t0, "runs": dict(zip((SMOL, OSS), runs))}


def report(rows: list[dict]) -> None:
    print(f"{'cells':>5} {'tokens':>12} {'path':>10} {'wall s':>7} {'smol TTFT':>9}  ratio vs split")
    by = {(r["cells"], r["how"]): r for r in rows}
    for r in rows:
        smol = r["runs"][SMOL]
        ratio = r["wall"] / by[r["cells"], "split"]["wall"]
        tokens = "/".join(str(r["runs"][m]["tokens"]) for m in (SMOL, OSS))
        ttft = "-" if smol["ttft"] is None else f"{smol['ttft']:.2f}"
        print(f"{r['cells']:>5} {tokens:>12} {r['how']:>10} {r['wall']:>7.2f} {ttft:>9}  {ratio:.2f}x")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hows = ["split", "local", "vllm-alone"]
    sizes = sorted({r["cells"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(hows)
    for i, how in enumerate(hows):
        xs = [j + i * width for j, c in enumerate(sizes) if any(r["cells"] == c and r["how"] == how for r in rows)]
        ys = [r["wall"] for c in sizes for r in rows if r["cells"] == c and r["how"] == how]
        ax.bar(xs, ys, width, label=how)
    labels = [next(str(r["runs"][SMOL]["tokens"]) for r in rows if r["cells"] == c) for c in sizes]
    ax.set_xticks([j + width for j in range(len(sizes))], labels)
    ax.set_xlabel("SmolLM2 prompt tokens (gpt-oss:tiny alongside)")
    ax.set_ylabel("seconds for both models' answers")
    ax.set_title("Grading workload on the one-machine site: split vs local vs vLLM alone")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="5,20,40", help="notebook cells per prompt (~55 tokens each)")
    p.add_argument("--num-predict", type=int, default=32)
    p.add_argument("--local-max-cells", type=int, default=5)
    p.add_argument("--plot", default="bench_site.png")
    p.add_argument("--json")
    p.add_argument("--running", action="store_true", help="use a site already up (make site)")
    p.add_argument("--smoke", action="store_true", help="smallest size, one rep (tests/bench/test_smoke.py)")
    args = p.parse_args()
    if args.smoke:
        args.cells, args.num_predict, args.local_max_cells, args.plot, args.json = "1", 4, 1, "", None
    from kv_bridge.config.settings import load_config

    site = None if args.running else Site(Path(tempfile.mkdtemp(prefix="bench-site-")))
    try:
        bench = Bench(load_config(CONFIG), args.num_predict)
        rows, tag = [], str(time.time_ns())
        for cells in (int(c) for c in args.cells.split(",")):
            for how in ("split", "local", "vllm-alone"):
                if how == "local" and cells > args.local_max_cells:
                    continue
                rows.append(bench.round(how, cells, tag))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}), flush=True)
        report(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        if args.plot:
            plot(rows, args.plot)
    finally:
        if site is not None:
            site.stop()


if __name__ == "__main__":
    main()
