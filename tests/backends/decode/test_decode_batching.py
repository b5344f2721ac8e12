"""Continuous batching on the real decode node: concurrent requests join and leave one mlx-lm BatchGenerator and
each gets exactly what it gets alone (and what MLX alone gives); cancelling one leaves the others untouched;
requests whose KV arrives over the bridge batch with locally prefilled ones."""

from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
import pytest

from kv_bridge import wire
from kv_bridge.fingerprint import kv_spec
from kv_bridge.sender import KVSender
from tests.support.stack import MODEL_DIR, MODEL_ID

pytestmark = pytest.mark.e2e

# (prompt, max_tokens, stop): different lengths, budgets and stop strings.
CASES = [
    ("The capital of France is", 12, []),
    ("Once upon a time, in a small village,", 20, ["."]),
    ("def fibonacci(n):", 16, []),
    ("1, 2, 3, 4,", 9, [" 8"]),
    ("Water boils at", 14, []),
    ("My favourite colour is", 7, ["\n"]),
]
# test_bridged_and_local_requests_batch_together's prompts and budget.
BATCHED = ["The tallest mountain in the world is", "Paris is a city that", "Here is a haiku about snow:",
           "The recipe needs flour, eggs and"]
BATCHED_MAX = 15


@pytest.fixture(scope="module")
def decode(stack):
    """The session stack's real decode node, driven directly: local prefill, or KV this test sends itself (its
    prefill node and gateway stay idle meanwhile)."""
    return stack


def body(ids: list[int], max_tokens: int, stop=(), **extra) -> dict:
    return {"request_id": uuid.uuid4().hex, "model": MODEL_ID, "token_ids": ids, "max_tokens": max_tokens,
            "temperature": 0, "stop": list(stop), **extra}


async def generate(session, stack, req: dict, on_token=None, cancel_after: int | None = None,
                   on_accepted=None) -> dict:
    """One /v1/generate; returns {"ids", "text", "done"}. `cancel_after` tokens: disconnect mid-stream."""
    ids, text, done = [], "", None
    async with session.post(stack.url("decode-0") + "/v1/generate", json=req, headers=stack.node_headers) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            ev = json.loads(raw)
            if ev["type"] == "accepted" and on_accepted is not None:
                await on_accepted()
            elif ev["type"] == "token":
                ids.append(ev["token_id"])
                text += ev["text"]
                if on_token is not None:
                    await on_token(len(ids))
                if cancel_after is not None and len(ids) >= cancel_after:
                    r.close()  # the client leaves mid-stream
                    break
            elif ev["type"] in ("done", "error"):
                done = ev
    return {"ids": ids, "text": text, "done": done}


async def health(session, stack) -> dict:
    async with session.get(stack.url("decode-0") + "/health", headers=stack.node_headers) as r:
        return await r.json()


async def settled(session, stack, timeout: float = 60) -> dict:
    """/health once nothing runs any more (a cancelled job leaves at the loop's next step)."""
    for _ in range(int(timeout / 0.1)):
        h = await health(session, stack)
        if h["running"] == 0 and h["batch_size"] == 0:
            return h
        await asyncio.sleep(0.1)
    raise AssertionError(f"decode node never settled: {h}")


def prompt_ids(tok, prompt: str) -> list[int]:
    return tok.encode(prompt)


def mlx_alone(mlx_ref, ids: list[int], max_tokens: int) -> list[int]:
    """MLX alone (mlx_lm.stream_generate in this process): the independent greedy reference."""
    from mlx_lm import stream_generate

    model, tok = mlx_ref
    return [r.token for r in stream_generate(model, tok, ids, max_tokens=max_tokens)]


def run(coro):
    return asyncio.run(coro)


async def one_by_one(stack, reqs: list[dict]) -> list[dict]:
    async with aiohttp.ClientSession() as s:
        return [await generate(s, stack, r) for r in reqs]


async def all_at_once(stack, reqs: list[dict]) -> list[dict]:
    async with aiohttp.ClientSession() as s:
        return await asyncio.gather(*(generate(s, stack, r) for r in reqs))


def case_requests(tok) -> list[dict]:
    """CASES, then a seeded sampled request (its own key: repeats are batched), as /v1/generate bodies."""
    reqs = [body(prompt_ids(tok, p), n, stop) for p, n, stop in CASES]
    return [*reqs, body(prompt_ids(tok, "Tell me a story:"), 10, temperature=0.9, seed=7)]


@pytest.fixture(scope="module")
def mlx_answers(mlx_ref):
    """MLX alone's greedy answers to CASES, then to BATCHED: a Future, computed in a thread of this process while the
    node (another process) serves the module's first requests, not after them (~140 single-sequence steps)."""
    _, tok = mlx_ref
    work = [(prompt_ids(tok, p), n) for p, n, _ in CASES] + [(prompt_ids(tok, p), BATCHED_MAX) for p in BATCHED]
    with ThreadPoolExecutor(1) as ex:
        yield ex.submit(lambda: [mlx_alone(mlx_ref, ids, n) for ids, n in work])


@pytest.fixture(scope="module")
def alone(decode, mlx_ref, mlx_answers) -> list[dict]:
    """case_requests run one at a time on the node, once for the module: what each gets alone."""
    return run(one_by_one(decode, case_requests(mlx_ref[1])))


def test_concurrent_requests_equal_each_alone_and_mlx_alone(decode, mlx_ref, alone, mlx_answers):
    _, tok = mlx_ref
    together = run(all_at_once(decode, case_requests(tok)))
    for (prompt, n, stop), a, b, ref in zip(CASES, alone, together, mlx_answers.result()):
        assert b["ids"] == a["ids"] and b["text"] == a["text"], prompt
        assert b["done"]["finish_reason"] == a["done"]["finish_reason"]
        if stop and a["done"]["finish_reason"] == "stop" and len(a["ids"]) < len(ref):  # cut at the stop string
            assert a["ids"] == ref[:len(a["ids"])] and any(s in tok.decode(ref) for s in stop), prompt
        else:
            assert a["ids"] == ref, prompt
    assert together[-1]["ids"] == alone[-1]["ids"] and len(alone[-1]["ids"]) == 10
    assert any(len(a["ids"]) < n for (_, n, _), a in zip(CASES, alone))  # some stop string was really hit


def test_short_request_overtakes_long_one(decode, mlx_ref):
    """Requests overlap: one started while a long one runs finishes first, and both were in the batch at once."""
    _, tok = mlx_ref
    long_started, order, sizes = asyncio.Event(), [], []

    async def main():
        async with aiohttp.ClientSession() as s:
            async def started(n):
                long_started.set()

            async def seen(n):
                if n == 1:  # the short one is in the batch; the long one has far to go
                    sizes.append((await health(s, decode))["batch_size"])

            async def long():
                # 48 tokens: the short one (12, started at the long one's first token) has 35 steps of margin
                await generate(s, decode, body(prompt_ids(tok, "A long essay about rivers:"), 48), started)
                order.append("long")

            async def short():
                await long_started.wait()
                await generate(s, decode, body(prompt_ids(tok, "Hello"), 12), seen)
                order.append("short")

            await asyncio.gather(long(), short())
            return await settled(s, decode)

    h = run(main())
    assert order == ["short", "long"]
    assert sizes and sizes[0] >= 2
    assert h["running"] == 0 and h["batch_size"] == 0 and h["cache_bytes"] == 0


def test_cancelled_request_leaves_the_others_unchanged(decode, mlx_ref, alone):
    _, tok = mlx_ref
    reqs = case_requests(tok)[:3]
    victim = body(prompt_ids(tok, "Count slowly from one to a hundred:"), 200)

    async def main():
        async with aiohttp.ClientSession() as s:
            outs = await asyncio.gather(generate(s, decode, victim, cancel_after=3),
                                        *(generate(s, decode, r) for r in reqs))
            return outs, await settled(s, decode)

    (cancelled, *others), h = run(main())
    assert len(cancelled["ids"]) == 3 and cancelled["done"] is None
    assert [(o["ids"], o["text"]) for o in others] == [(a["ids"], a["text"]) for a in alone[:3]]
    assert h["running"] == 0 and h["batch_size"] == 0 and h["cache_bytes"] == 0  # the victim's cache is freed


def mlx_kv(model, ids: list[int]):
    """MLX's own prefill of `ids` as (L, H, T, D) float32: the KV a prefill node would send."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import cache_kv

    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    return cache_kv(cache, len(ids))


def send_kv(port: int, tid: str, keys: np.ndarray, values: np.ndarray, key: bytes | None = None) -> None:
    """Stream KV to the decode node's receiver with the bridge's real sender (one frame per layer)."""
    spec = kv_spec(MODEL_DIR)
    hdr = wire.StreamHeader(transfer_id=tid, fingerprint=spec["fingerprint"], num_layers=spec["num_layers"],
                            num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"], dtype="float32", start=0,
                            num_tokens=keys.shape[2])
    sender = KVSender(key=key)  # signed with the stack's KV key, as its prefill node signs
    try:
        sender.open(hdr, "127.0.0.1", port)
        for layer in range(keys.shape[0]):
            sender.send_layer(tid, layer, 0, np.ascontiguousarray(keys[layer]), np.ascontiguousarray(values[layer]))
        sender.close(tid)
        sender.flush()
    finally:
        sender.shutdown()


def test_bridged_and_local_requests_batch_together(decode, mlx_ref, mlx_answers):
    model, tok = mlx_ref
    prompts = BATCHED
    ids = [prompt_ids(tok, p) for p in prompts]
    bridged = {0, 2}
    refs = mlx_answers.result()[len(CASES):]  # first: this process's MLX runs one thread at a time
    kv = {i: mlx_kv(model, ids[i][:-1]) for i in bridged}
    kv_port, key = decode.settings.node("decode-0").kv_port, decode.kv_key

    async def main():
        async with aiohttp.ClientSession() as s:
            async def one(i):
                if i not in bridged:
                    return await generate(s, decode, body(ids[i], BATCHED_MAX))
                req = body(ids[i], BATCHED_MAX, kv={"tokens": len(ids[i]) - 1})
                # The transfer is registered once the node accepted: send the KV then, like a prefill node.
                send = lambda: asyncio.to_thread(send_kv, kv_port, req["request_id"], *kv[i], key)  # noqa: E731
                return await generate(s, decode, req, on_accepted=send)

            outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            return outs, await settled(s, decode)

    outs, h = run(main())
    for i, out in enumerate(outs):
        assert out["ids"] == refs[i], prompts[i]
        assert out["done"]["kv_tokens"] == (len(ids[i]) - 1 if i in bridged else 0), out["done"]
        assert out["done"]["fallback_reason"] is None
    assert h["running"] == 0 and h["batch_size"] == 0 and h["cache_bytes"] == 0


def test_finished_cache_continues_like_mlx_alone(mlx_ref):
    """The prefix-reuse hook: a finished job hands over its cache and the tokens it holds (prompt + generated);
    a new job started from that cache, running only what follows, decodes exactly as MLX alone on everything."""
    from backends.decode.engine import Job, MLXModel
    from kv_bridge.protocol import Sampling

    _, tok = mlx_ref
    m = MLXModel(MODEL_ID, str(MODEL_DIR))

    async def main():
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(m.executor, m.load)
        m.start()

        async def run(tokens, max_tokens, **kw):
            q, handed = asyncio.Queue(), []
            job = Job(tokens=tokens, gen=Sampling(max_tokens=max_tokens), **kw,
                      emit=lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev),
                      on_finished=lambda toks, cache: handed.append((toks, cache)))
            m.submit(job)
            out = []
            while (ev := await q.get()) is not None:
                out.append(ev[1].token_id)
            return out, handed

        prompt = prompt_ids(tok, "The three primary colours are")
        first, handed = await run(prompt, 6)
        (held, cache), = handed
        follow = prompt_ids(tok, " Also,")
        second, _ = await run(follow, 8, make_cache=lambda: cache, history=held)
        return first, held, cache, follow, second

    try:
        first, held, cache, follow, second = run(main())
    finally:
        m.stop()
    assert held == prompt_ids(tok, "The three primary colours are") + first
    assert all(c.offset == len(held) for c in cache)
    assert second == mlx_alone(mlx_ref, held + follow, 8)
