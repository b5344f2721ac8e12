"""The real decode node never decodes on partial or foreign KV: aborted, corrupt or mismatched transfers make
it prefill locally, report why, and give the same greedy answer."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from kv_bridge import wire
from tests.support.stack import MODEL_ID, send_then_drain

pytestmark = pytest.mark.e2e
PROMPT = "What is the capital of France?"


async def generate(stack, ids, kv_tokens, rid, on_accepted):
    """POST /v1/generate on the decode node; run `on_accepted` once the transfer is registered."""
    body = {"request_id": rid, "model": MODEL_ID, "token_ids": ids, "max_tokens": 12, "temperature": 0,
            "kv": {"tokens": kv_tokens}}
    async with aiohttp.ClientSession(headers=stack.node_headers) as s:
        async with s.post(stack.url("decode-0") + "/v1/generate", json=body) as r:
            assert r.status == 200
            assert json.loads(await r.content.readline())["type"] == "accepted"
            await on_accepted(s)
            lines = [json.loads(ln) async for ln in r.content]
    text = "".join(ev["text"] for ev in lines if ev["type"] == "token")
    return text, lines[-1]


def ids_for(hf_tokenizer, content=PROMPT):
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def send_raw(port: int, frames: list[bytes]) -> None:
    send_then_drain(port, frames, timeout=5)


def test_abort_makes_decode_prefill_locally(stack, hf_tokenizer):
    ids = ids_for(hf_tokenizer)

    async def abort(s):
        async with s.post(stack.url("decode-0") + "/v1/transfers/r-abort/abort") as r:
            assert (await r.json())["aborted"] is True

    text, done = asyncio.run(generate(stack, ids, len(ids) - 1, "r-abort", abort))
    assert done["fallback_reason"] == "kv_aborted"
    assert done["kv_tokens"] == 0 and done["computed_tokens"] == len(ids)
    assert text.startswith("The capital of France is Paris.")


@pytest.mark.parametrize("case", ["corrupt", "truncated", "foreign_model"])
def test_bad_stream_makes_decode_prefill_locally(stack, hf_tokenizer, case):
    ids = ids_for(hf_tokenizer)
    n = len(ids) - 1
    rid = f"r-{case}"
    spec = json.loads(urllib_get(stack.url("decode-0") + "/health", stack.node_headers))
    hdr = wire.StreamHeader(transfer_id=rid, fingerprint=spec["fingerprint"][MODEL_ID], num_layers=30,
                            num_kv_heads=3, head_dim=64, dtype="float32", start=0, num_tokens=n)
    if case == "foreign_model":
        hdr = wire.StreamHeader(**{**hdr.to_json(), "fingerprint": "0123456789abcdef"})
    import numpy as np

    k = np.zeros((3, n, 64), np.float32)
    # signed as the stack's prefill node would (its nodes share a secret): only the damage below is wrong
    head, frame = stack.kv_stream(hdr, wire.kv_frame_parts(0, 0, k, k))
    frame = bytearray(frame)
    if case == "corrupt":
        frame[50] ^= 0xFF
    if case == "truncated":
        frame = frame[: len(frame) // 3]
    frames = [head, bytes(frame)]

    async def inject(s):
        await asyncio.to_thread(send_raw, stack.settings.node("decode-0").kv_port, frames)

    text, done = asyncio.run(generate(stack, ids, n, rid, inject))
    assert done["fallback_reason"] == "kv_error"
    assert done["kv_tokens"] == 0
    assert text.startswith("The capital of France is Paris.")


def urllib_get(url: str, headers: dict | None = None) -> str:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
        return r.read().decode()
