"""Quantized decode caches: KV the bridge delivers becomes mlx-lm QuantizedKVCache (4 or 8 bit), and greedy
decode from it equals MLX alone generating with the same kv_bits. In process the model is a tiny random llama
(tests/support/tiny_models.py), compared by its log-probabilities as well as its tokens; the e2e test uses SmolLM2."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from tests.support import tiny_models
from kv_bridge.mlx.cache import build_prompt_cache, cache_kv, quantize

PROMPT = "Explain in one sentence why the sky is blue. " * 4


def greedy(model, tok, prompt, cache=None, **kw) -> list[int]:
    return [r.token for r in stream_generate(model, tok, mx.array(prompt), max_tokens=16, prompt_cache=cache, **kw)]


def steps(model, tok, prompt, cache=None, **kw) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each step's log-probabilities."""
    rs = list(stream_generate(model, tok, mx.array(prompt), max_tokens=16, prompt_cache=cache, **kw))
    return [r.token for r in rs], np.stack([np.array(r.logprobs) for r in rs])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model, tokenizer): a tiny random llama (head_dim 64, one quantization group per head) in float32."""
    from mlx_lm import load

    return load(str(tiny_models.build("llama", tmp_path_factory.mktemp("llama") / "llama")))


@pytest.mark.parametrize("bits", [4, 8])
def test_bridged_kv_into_quantized_cache_decodes_like_mlx(llama, bits):
    model, tok = llama
    ids = tok.encode(PROMPT)
    ref_cache = make_prompt_cache(model)  # MLX's own prefill of the prefix: the KV a prefill node would send
    model(mx.array(ids[:-1])[None], cache=ref_cache)
    keys, values = cache_kv(ref_cache, len(ids) - 1)

    cache = quantize(build_prompt_cache(model, keys, values), bits, 64)
    assert all(isinstance(c, QuantizedKVCache) and c.bits == bits and c.offset == len(ids) - 1 for c in cache)
    ours = steps(model, tok, ids[-1:], cache, kv_bits=bits, kv_group_size=64, quantized_kv_start=0)
    alone = steps(model, tok, ids, kv_bits=bits, kv_group_size=64, quantized_kv_start=0)
    assert ours[0] == alone[0] and np.allclose(ours[1], alone[1], rtol=0, atol=1e-4)


def test_quantizing_sliding_window_caches_is_refused():
    from mlx_lm.models.cache import RotatingKVCache

    with pytest.raises(ValueError, match="RotatingKVCache"):
        quantize([RotatingKVCache(max_size=16)], 8)


@pytest.mark.e2e
def test_quantized_decode_node_through_the_split(stack, mlx_ref, hf_tokenizer, tmp_path):
    """A decode node configured with decode.kv_bits=8 takes KV from the real prefill node into 8-bit caches."""
    import asyncio
    import json
    from concurrent.futures import ThreadPoolExecutor

    import aiohttp

    from tests.support.stack import MODEL_ID, Stack

    q = Stack(tmp_path, node_secret=stack.settings.auth.node_secret.get_secret_value())  # takes stack's signed KV
    try:
        text = hf_tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                tokenize=False)
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        model, tok = mlx_ref
        with ThreadPoolExecutor(1) as ex:  # the node starts (imports, model load) while MLX computes the reference
            started = ex.submit(q.start, "decode-0", env={"DISAGG_DECODE__KV_BITS": "8"})
            alone = greedy(model, tok, ids, kv_bits=8, kv_group_size=64, quantized_kv_start=0)
            started.result()

        async def run():
            body = {"request_id": "q8", "model": MODEL_ID, "token_ids": ids, "max_tokens": 16, "temperature": 0,
                    "kv": {"tokens": len(ids) - 1}}
            target = {"host": "127.0.0.1", "port": q.settings.node("decode-0").kv_port}
            async with aiohttp.ClientSession(headers=stack.node_headers) as s:  # one secret: one credential
                async with s.post(q.url("decode-0") + "/v1/generate", json=body) as r:
                    await r.content.readline()
                    async with s.post(stack.url("prefill-0") + "/v1/prefill", json={
                            "request_id": "q8", "model": MODEL_ID, "token_ids": ids[:-1], "kv_target": target}) as p:
                        assert p.status == 200
                    return [json.loads(ln) async for ln in r.content]

        lines = asyncio.run(run())
        assert lines[-1]["type"] == "done" and lines[-1]["kv_tokens"] == len(ids) - 1, lines[-1]
        tokens = [ev["token_id"] for ev in lines if ev["type"] == "token"]
        assert tokens == alone
    finally:
        q.stop()
