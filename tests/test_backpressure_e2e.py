"""In-flight KV is capped per decode node (kv.max_inflight_bytes): the real decode node refuses a request whose KV
would pass the cap with 429 + Retry-After (code kv_capacity), releases each request's share when it ends, and
serves again. The gateway's side (try the next node, then 429) is in tests/test_failover.py."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from stack import MODEL_ID, Stack

pytestmark = pytest.mark.e2e
PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2: K and V, 30 layers, 3 KV heads, head_dim 64, float32
CAP_TOKENS = 100


@pytest.fixture(scope="module")
def decode_only(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("cap"), env={"DISAGG_KV__MAX_INFLIGHT_BYTES": str(CAP_TOKENS * PER_TOKEN)})
    with s.running(["decode-0"]):
        yield s


def body(rid: str, kv_tokens: int) -> dict:
    return {"request_id": rid, "model": MODEL_ID, "token_ids": list(range(1, kv_tokens + 2)), "max_tokens": 2,
            "temperature": 0, "kv": {"tokens": kv_tokens}}


async def test_kv_over_the_cap_is_refused_with_429_and_released_after_use(decode_only):
    url = decode_only.url("decode-0")
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/generate", json=body("too-big", CAP_TOKENS + 1)) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            err = (await r.json())["error"]
        assert err["code"] == "kv_capacity" and "max_inflight_bytes" in err["message"]

        # 60 tokens fit; while that request waits for its KV, 60 more do not.
        held = await s.post(url + "/v1/generate", json=body("held", 60))
        assert json.loads(await held.content.readline())["type"] == "accepted"
        async with s.post(url + "/v1/generate", json=body("second", 60)) as r:
            assert r.status == 429
        # The held request's KV never comes: abort it, it prefills locally and ends, and its share is released.
        async with s.post(url + "/v1/transfers/held/abort") as r:
            assert (await r.json())["aborted"] is True
        lines = [json.loads(ln) async for ln in held.content]
        held.release()
        assert lines[-1]["type"] == "done" and lines[-1]["fallback_reason"] == "kv_aborted"

        second = await s.post(url + "/v1/generate", json=body("second", 60))
        assert second.status == 200
        assert json.loads(await second.content.readline())["type"] == "accepted"
        async with s.post(url + "/v1/transfers/second/abort") as r:
            assert (await r.json())["aborted"] is True
        assert [json.loads(ln) async for ln in second.content][-1]["type"] == "done"
        second.release()
        async with s.get(url + "/health") as r:
            assert (await r.json())["running"] == 0
