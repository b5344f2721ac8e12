"""The decode node's canary routes end to end in process (issue #50): the real DecodeService and its MLX thread on a
tiny llama, a stand-in prefill route that computes the canary's KV with MLX and pushes it with the real KVSender, and
the caller's run_canary. The canary is held past the node's KV cap (never a 429), and a comparison that waits longer
than its timeout behind a busy MLX step still answers verified: the node heartbeats, its wait is not its run. A
calibrated gain band and the long form, when asked for, ride into the comparison."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from aiohttp import web

from backends.decode import canary
from backends.decode.node import DecodeService
from kv_bridge import fidelity, wire
from kv_bridge.config.settings import Settings
from kv_bridge.sender import KVSender
from tests.support import tiny_models
from tests.support.stack import free_port

TIMEOUT_S, BUSY_S = 3.0, 5.0  # the busy MLX step outlasts the canary's timeout


def _service(model_dir) -> DecodeService:
    s = Settings(gateway={"host": "127.0.0.1", "port": free_port()}, prefill={}, decode={},
                 kv={"max_inflight_bytes": 1024},  # far below the canary's KV: a request would get a 429
                 fidelity={"canary_tokens": 40, "start_canary_tokens": 96, "timeout_s": TIMEOUT_S},
                 nodes=[{"name": "decode-0", "role": "decode", "host": "127.0.0.1", "port": free_port(),
                         "kv_port": free_port()}],
                 models=[{"id": "tiny", "path": str(model_dir), "prefill": [], "decode": ["decode-0"]}])
    return DecodeService(s, s.node("decode-0"))


def _prefill_route(m):
    """POST /v1/prefill as a prefill node answers it: the KV of token_ids from kv_start on (MLX's own, as vLLM's
    float32 matches it) pushed to kv_target, layer by layer."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import cache_kv

    def push(body: dict) -> None:
        ids, spec, target, start = body["token_ids"], m.spec, body["kv_target"], body.get("kv_start", 0)
        cache = make_prompt_cache(m.model)
        m.model(mx.array(ids)[None], cache=cache)  # its own model copy's thread would be vLLM's; here: same weights
        k, v = cache_kv(cache, len(ids))
        s = KVSender(max_bytes=64 << 20)
        s.open(wire.StreamHeader(transfer_id=body["request_id"], fingerprint=spec["fingerprint"],
                                 num_layers=spec["num_layers"], num_kv_heads=spec["num_kv_heads"],
                                 head_dim=spec["head_dim"], dtype="float32", start=start, num_tokens=len(ids) - start),
               target["host"], target["port"])
        for layer in range(k.shape[0]):
            s.send_layer(body["request_id"], layer, start, np.ascontiguousarray(k[layer][:, start:]),
                         np.ascontiguousarray(v[layer][:, start:]))  # from kv_start, as a prefill node sends
        s.close(body["request_id"])
        s.flush()
        s.shutdown()

    async def handler(request: web.Request) -> web.Response:
        await asyncio.to_thread(push, await request.json())
        return web.json_response({"ok": True})
    return handler


async def test_a_canary_past_the_kv_cap_and_behind_a_busy_mlx_step_still_verifies(tmp_path, empty_config,
                                                                                    monkeypatch):
    import aiohttp

    monkeypatch.setattr(canary, "HEARTBEAT_S", 0.2)  # so the caller's read window (timeout + 4 beats) is short
    monkeypatch.setattr(fidelity, "HEARTBEAT_S", 0.2)
    svc = _service(tiny_models.build("llama", tmp_path / "tiny"))
    m = svc.models["tiny"]
    await asyncio.to_thread(m.load)
    m.start()
    await svc.receiver.start("127.0.0.1", svc.node.kv_port)
    app = web.Application()
    canary.register(app, svc)
    twin = await asyncio.to_thread(lambda: _twin(m))
    app.router.add_post("/v1/prefill", _prefill_route(twin))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url, release = f"http://127.0.0.1:{port}", threading.Event()

    def busy():  # one MLX step as long as a batch's prefill chunk of 8 x 2048 tokens on a Mac
        release.wait(BUSY_S)
        yield

    try:
        async with aiohttp.ClientSession() as http:
            v = await fidelity.run_canary(http, "tiny", ("p", url), ("decode-0", url), {}, TIMEOUT_S)
            assert v.state == "verified" and v.weights == "full", v.summary()  # exempt from the KV cap
            m.run_task(busy)
            v = await fidelity.run_canary(http, "tiny", ("p", url), ("decode-0", url), {}, TIMEOUT_S)
            assert v.state == "verified", v.summary()  # its BUSY_S in the queue was not its TIMEOUT_S
            # The gateway's asks (issue #50): the pair's calibrated gain band, and the long form after real traffic
            # demoted the pair.
            band = fidelity.gain_band([v.layers])
            w = await fidelity.run_canary(http, "tiny", ("p", url), ("decode-0", url), {}, TIMEOUT_S,
                                          {"gain_band": band, "long": True})
            assert w.ok and w.gain_band and w.long and w.tokens > v.tokens and not v.long, w.summary()
    finally:
        release.set()
        await runner.cleanup()
        await svc.receiver.stop()
        m.stop()


def _twin(m):
    """The same model loaded again: the stand-in prefill side's own copy (it runs off the MLX thread)."""
    from types import SimpleNamespace

    from mlx_lm import load

    model, _ = load(m.path)
    return SimpleNamespace(model=model, spec=m.spec)
