"""Cancellation soak: 1,000 short requests against a real decode node, many of them abandoned mid-stream or while
waiting for KV, then nothing may have grown: no request running, an empty batch, no KV transfer left registered,
cache bytes back to their start value, and the process's RSS within RSS_BOUND of its value after a warm-up.

The node serves a tiny random llama (tests/support/tiny_models.py, SmolLM2's tokenizer): the soak checks the node's
machinery, and SmolLM2 on this shared CPU would take ten times the few minutes it may take."""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import aiohttp
import psutil
import pytest

from tests.support import tiny_models
from tests.support.stack import MODEL_ID, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.soak, pytest.mark.timeout(900)]
REQUESTS = 1000
WARMUP = 64
CONCURRENCY = 32
RSS_BOUND = 128 << 20  # MLX's buffer cache and the allocator may keep this much; a per-request leak would not fit
WORDS = "the river runs past old mills and quiet farms toward a distant grey sea".split()


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    folder = tmp_path_factory.mktemp("soak")
    # KV never comes for the "leave_kv" requests: a node that kept waiting after their clients left would hold
    # them (and their transfers) far beyond the soak, so the check below would see them.
    s = Stack(folder, kv_timeout_s=3600, model_dir=tiny_models.build("llama", folder / "tiny-llama"))
    with s.running(["decode-0"]):
        yield s


async def one(s: aiohttp.ClientSession, url: str, rng: random.Random, tok) -> str:
    """One request in one of four shapes; returns what happened (for the printed tally)."""
    ids = tok.encode(" ".join(rng.choices(WORDS, k=rng.randint(2, 8))))
    shape = rng.choices(["full", "cancel", "abort_kv", "leave_kv"], weights=[5, 4, 1, 1])[0]
    body = {"request_id": uuid.uuid4().hex, "model": MODEL_ID, "token_ids": ids, "max_tokens": rng.randint(1, 4),
            "temperature": rng.choice([0.0, 0.8]), "seed": rng.choice([None, 3])}
    if shape in ("abort_kv", "leave_kv"):
        body["kv"] = {"tokens": len(ids) - 1} if len(ids) > 1 else None
    cut = rng.randint(1, 2)
    async with s.post(url + "/v1/generate", json=body) as r:
        assert r.status == 200, await r.text()
        n = 0
        async for raw in r.content:
            ev = json.loads(raw)
            if ev["type"] == "accepted" and shape == "leave_kv" and body["kv"]:
                r.close()  # the client leaves while the node waits for KV
                return shape
            if ev["type"] == "accepted" and shape == "abort_kv" and body["kv"]:
                async with s.post(f"{url}/v1/transfers/{body['request_id']}/abort") as a:
                    assert a.status == 200
            if ev["type"] == "token":
                n += 1
                if shape == "cancel" and n >= cut:
                    r.close()  # the client leaves mid-stream
                    return shape
            if ev["type"] == "error":
                raise AssertionError(ev)
    return shape


async def burst(url: str, count: int, seed: int, tok) -> dict[str, int]:
    rng, sem, tally = random.Random(seed), asyncio.Semaphore(CONCURRENCY), {}

    async def guarded(s):
        async with sem:
            shape = await one(s, url, rng, tok)
            tally[shape] = tally.get(shape, 0) + 1

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(guarded(s) for _ in range(count)))
    return tally


async def settled(url: str, timeout: float = 120) -> dict:
    async with aiohttp.ClientSession() as s:
        for _ in range(int(timeout / 0.2)):
            async with s.get(url + "/health") as r:
                h = await r.json()
            if h["running"] == 0 and h["batch_size"] == 0 and h["transfers"] == 0:
                return h
            await asyncio.sleep(0.2)
    raise AssertionError(f"decode node never settled: {h}")


def test_cancellation_soak_leaves_nothing_behind(decode, hf_tokenizer):
    url = decode.url("decode-0")
    proc = psutil.Process(decode.procs["decode-0"].pid)
    start = asyncio.run(settled(url))
    asyncio.run(burst(url, WARMUP, 0, hf_tokenizer))
    warm_rss = proc.memory_info().rss
    tally = asyncio.run(burst(url, REQUESTS, 1, hf_tokenizer))
    end = asyncio.run(settled(url))
    end_rss = proc.memory_info().rss
    print(f"\nsoak: {REQUESTS} requests {tally}; cache_bytes {start['cache_bytes']} -> {end['cache_bytes']}; "
          f"RSS after warm-up {warm_rss / 2**20:.0f} MiB -> after soak {end_rss / 2**20:.0f} MiB "
          f"(+{(end_rss - warm_rss) / 2**20:.1f} MiB, bound {RSS_BOUND >> 20} MiB)")
    assert tally.get("cancel", 0) > 100 and tally.get("leave_kv", 0) > 20 and tally.get("abort_kv", 0) > 20
    assert end["running"] == 0 and end["batch_size"] == 0 and end["transfers"] == 0
    assert end["cache_bytes"] == start["cache_bytes"] == 0
    assert end_rss - warm_rss <= RSS_BOUND
