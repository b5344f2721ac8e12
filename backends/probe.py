"""KV link probe for `disagg status`: a test transfer over the real KV path (same port, header, auth and receiver).

Decode: POST /v1/probe/expect registers a transfer, GET /v1/probe/{tid} waits for it. Prefill: POST /v1/probe/send
streams zeros of its own model's geometry there, so a fingerprint mismatch on the KV path shows up too.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
from aiohttp import web

from backends.common import NodeError, bad_request, json_body
from kv_bridge import wire
from kv_bridge.config.models import resolve_model_path
from kv_bridge.fingerprint import kv_spec
from kv_bridge.receiver import TransferError

PROBE_PREFIX = "probe-"
_MAX_PROBE_BYTES = 1 << 30


def tokens_for(spec: dict, nbytes: int) -> int:
    """Tokens of float32 KV that make about `nbytes` over all layers (at least 1)."""
    per_token = 2 * spec["num_layers"] * spec["num_kv_heads"] * spec["head_dim"] * 4
    return max(1, min(nbytes, _MAX_PROBE_BYTES) // per_token)


def register_decode(app: web.Application, svc) -> None:
    """Probe routes on a decode node; `svc` has `.receiver` and `.models` (model id -> object with `.spec`)."""

    async def expect(request: web.Request) -> web.Response:
        body = await json_body(request)
        m = svc.models.get(body.get("model"))
        if m is None:
            raise NodeError(404, f"model {body.get('model')!r} is not served here", "model_not_found")
        nbytes = body.get("bytes")
        if not isinstance(nbytes, int) or nbytes < 1:
            raise bad_request("bytes must be a positive integer")
        n = min(tokens_for(m.spec, nbytes), svc.settings.kv.max_tokens)
        tid = PROBE_PREFIX + uuid.uuid4().hex
        svc.receiver.expect(tid, n, m.spec)
        return web.json_response({"transfer_id": tid, "tokens": n, "kv_target": svc.node.kv_target})

    async def result(request: web.Request) -> web.Response:
        tid = request.match_info["tid"]
        t = svc.receiver.transfers.get(tid)
        if not tid.startswith(PROBE_PREFIX) or t is None:
            raise NodeError(404, f"no probe transfer {tid!r}", "not_found")
        try:
            kv = await t.result(float(request.query.get("timeout", 30)))
            out = {"ok": True, "bytes": kv.nbytes, "seconds": kv.seconds}
            kv.release()
        except TransferError as e:
            out = {"ok": False, "error": str(e), "reason": e.reason}
        finally:
            svc.receiver.forget(tid)
        return web.json_response(out)

    app.router.add_post("/v1/probe/expect", expect)
    app.router.add_get("/v1/probe/{tid}", result)


def register_prefill(app: web.Application, svc) -> None:
    """Probe route on a prefill node; `svc` has `.settings` and `.routes` (model id -> ModelRoute)."""

    async def send(request: web.Request) -> web.Response:
        body = await json_body(request)
        route = svc.routes.get(body.get("model"))
        if route is None:
            raise NodeError(404, f"model {body.get('model')!r} is not served here", "model_not_found")
        target, tid, n = body.get("kv_target") or {}, body.get("transfer_id"), body.get("tokens")
        if not (isinstance(tid, str) and tid.startswith(PROBE_PREFIX) and isinstance(n, int) and n >= 1
                and isinstance(target.get("host"), str) and isinstance(target.get("port"), int)):
            raise bad_request("need transfer_id (probe-...), tokens >= 1 and kv_target {host, port}")
        spec = kv_spec(resolve_model_path(route, role="prefill"))  # this node's own model: a mismatch is refused by the receiver
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(None, send_zeros, svc.settings, spec, tid, n, target)
        return web.json_response(out)

    app.router.add_post("/v1/probe/send", send)


def send_zeros(settings, spec: dict, tid: str, n: int, target: dict) -> dict:
    """Blocking: one KV stream of `n` float32 zero tokens per layer through a KVSender, as the connector sends."""
    from kv_bridge.sender import KVSender

    sender = KVSender(settings.kv.sender_bytes, settings.kv.connect_timeout_s, settings.auth.kv_key(),
                      settings.auth.kv_frame_mac, settings.kv.send_timeout_s)
    hdr = wire.StreamHeader(transfer_id=tid, fingerprint=spec["fingerprint"], num_layers=spec["num_layers"],
                            num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"], dtype="float32",
                            start=0, num_tokens=n)
    zeros = np.zeros((spec["num_kv_heads"], n, spec["head_dim"]), np.float32)  # (H, T, D) per layer
    t0 = time.perf_counter()
    try:
        sender.open(hdr, target["host"], target["port"])
        for layer in range(spec["num_layers"]):
            sender.send_layer(tid, layer, 0, zeros, zeros)
        sender.close(tid)
        sender.flush()
        stats = sender.stats
        return {"ok": stats.failed_transfers == 0, "sent_bytes": stats.sent_bytes,
                "seconds": time.perf_counter() - t0}
    finally:
        sender.shutdown()
