"""The decode node holds bridged KV in its model's dtype: every wire dtype (float32, float16, bfloat16, fp8 + scale)
into a bfloat16 or float16 model, over real sockets (KVSender -> KVReceiver); what it reserves, pools and budgets.

Reference: the same transfer received as float32 (the old path, what MLX used to cast), cast by MLX itself to the
model's dtype; bf16 must match it bit for bit (one rounding, nearest-even). A tiny random llama converted to bf16
and to 4-bit by mlx-lm's own convert is the model; MLX's own prefill and greedy decode of it is the answer to match.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import mlx.core as mx
import numpy as np
import pytest
from aiohttp import web

from tests.support import tiny_models
from kv_bridge import dtypes, wire
from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVCapacityError, KVReceiver, TransferError
from kv_bridge.sender import KVSender
from tests.support.stack import free_port

L, H, D = 4, 2, 64
SPEC = {"fingerprint": "abc123", "num_layers": L, "num_kv_heads": H, "head_dim": D}
MX = {"bfloat16": mx.bfloat16, "float16": mx.float16}


def kv_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)  # spread over exponents, so rounding is exercised everywhere
    scale = np.exp2(rng.integers(-6, 6, (L, H, n, D))).astype(np.float32)
    return rng.standard_normal((L, H, n, D), np.float32) * scale, rng.standard_normal((L, H, n, D), np.float32)


def payload(x: np.ndarray, wire_dtype: str) -> tuple[np.ndarray, float]:
    """(codes, scale) as a prefill node puts x on the wire in `wire_dtype`."""
    if wire_dtype == "float32":
        return x, 1.0
    if wire_dtype == "float16":
        return x.astype(np.float16), 1.0
    if wire_dtype == "bfloat16":
        return np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16)), 1.0
    scale = float(np.abs(x).max() / dtypes.E4M3_MAX)
    return dtypes.e4m3_encode(x, scale), scale


async def receive(keys, values, wire_dtype: str, target: str, chunks=(0, 40), cfg: KVConfig | None = None):
    """One transfer of (L, H, n, D) KV sent in `wire_dtype` (chunked: several frames a layer), held in `target`."""
    n = keys.shape[2]
    (kc, ks), (vc, vs) = payload(keys, wire_dtype), payload(values, wire_dtype)
    rx = KVReceiver(cfg or KVConfig())
    port = free_port()
    await rx.start("127.0.0.1", port)
    try:
        t = rx.expect("t1", n, SPEC, dtype=target)

        def send():
            s = KVSender(max_bytes=64 << 20)
            s.open(wire.StreamHeader(transfer_id="t1", fingerprint="abc123", num_layers=L, num_kv_heads=H,
                                     head_dim=D, dtype=wire_dtype, start=0, num_tokens=n), "127.0.0.1", port)
            bounds = [*chunks, n]
            for a, b in zip(bounds, bounds[1:]):
                for layer in range(L):
                    s.send_layer("t1", layer, a, np.ascontiguousarray(kc[layer, :, a:b]),
                                 np.ascontiguousarray(vc[layer, :, a:b]), scales=np.array([ks, vs]))
            s.close("t1")
            s.flush()
            s.shutdown()
        await asyncio.to_thread(send)
        return await t.result(10), rx.inflight_bytes
    finally:
        await rx.stop()


def as_mx(a: np.ndarray, name: str) -> mx.array:
    return mx.array(a).view(mx.bfloat16) if name == "bfloat16" else mx.array(a)


@pytest.mark.parametrize("wire_dtype", ["float32", "float16", "bfloat16", "float8_e4m3"])
def test_every_wire_dtype_into_a_bf16_model_is_held_as_bf16_rounded_once(wire_dtype):
    n = 100
    k, v = kv_data(n)
    f32, f32_reserved = asyncio.run(receive(k, v, wire_dtype, "float32"))
    got, reserved = asyncio.run(receive(k, v, wire_dtype, "bfloat16"))
    assert got.dtype == "bfloat16" and got.keys.dtype == got.values.dtype == np.uint16
    assert got.keys.shape == got.values.shape == (L, H, n, D)
    per_token = (got.keys.nbytes + got.values.nbytes) // n
    assert per_token == 2 * L * H * D * 2 == (f32.keys.nbytes + f32.values.nbytes) // n // 2
    assert reserved == per_token * n == f32_reserved // 2
    assert got.nbytes == f32.nbytes == 2 * L * H * n * D * dtypes.itemsize(wire_dtype)  # as they crossed the wire
    for mine, ref in ((got.keys, f32.keys), (got.values, f32.values)):  # MLX's cast of the float32 path, bit for bit
        assert np.array_equal(mine, np.array(mx.array(ref).astype(mx.bfloat16).view(mx.uint16)))
    if wire_dtype == "bfloat16":  # nothing to round: the bytes as sent (landed in place)
        assert np.array_equal(got.keys, payload(k, "bfloat16")[0])


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16", "float8_e4m3"])
def test_a_float16_model_holds_float16(wire_dtype):
    k, v = kv_data(50, seed=1)
    k, v = k.clip(-6e4, 6e4), v  # inside float16's range
    f32, _ = asyncio.run(receive(k, v, wire_dtype, "float32", chunks=(0,)))
    got, reserved = asyncio.run(receive(k, v, wire_dtype, "float16", chunks=(0,)))
    assert got.keys.dtype == np.float16 and reserved == 2 * L * H * D * 2 * 50
    assert np.array_equal(got.keys, np.array(mx.array(f32.keys).astype(mx.float16)))
    assert np.array_equal(got.values, np.array(mx.array(f32.values).astype(mx.float16)))


def test_in_flight_cap_and_pool_count_the_held_bytes(empty_config):
    """kv.max_inflight_bytes that holds 100 tokens in bf16 holds only 50 in float32; the pool keeps bf16 buffers."""
    per_token_bf16 = 2 * L * H * D * 2
    cfg = KVConfig(max_inflight_bytes=100 * per_token_bf16, max_transfer_bytes=100 * per_token_bf16)

    async def go():
        rx = KVReceiver(cfg)
        rx.expect("a", 100, SPEC, dtype="bfloat16")
        assert rx.inflight_bytes == 100 * per_token_bf16
        rx.forget("a")
        with pytest.raises(KVCapacityError):
            rx.expect("b", 100, SPEC)  # float32: twice the bytes
        rx.expect("c", 50, SPEC)
        assert rx.inflight_bytes == 100 * per_token_bf16
        with pytest.raises(ValueError, match="not supported on a decode node"):
            rx.expect("d", 1, SPEC, dtype="float8_e4m3")
        rx.expect("canary", 10, SPEC, exempt=True)  # the fidelity canary: over the cap, still held (issue #50)
        assert rx.inflight_bytes == 100 * per_token_bf16 + 10 * per_token_bf16 * 2
    asyncio.run(go())
    k, v = kv_data(100)
    cfg = KVConfig(max_transfer_bytes=100 * per_token_bf16)  # the header's bound counts the bytes held too
    got, _ = asyncio.run(receive(k, v, "float32", "bfloat16", cfg=cfg))
    assert got.keys.nbytes == 50 * per_token_bf16
    with pytest.raises(TransferError, match="over the configured bound"):
        asyncio.run(receive(k, v, "float32", "float32", cfg=cfg))


def test_pooled_buffers_serve_another_dtype():
    """The pool holds raw bytes: a float32 transfer's released buffers serve the next bf16 one, and back."""
    from kv_bridge.assembly import BufferPool

    pool = BufferPool(1 << 20)
    a = pool.take(4096)
    pool.give(a)
    b = pool.take(2048)
    assert b is a and b.dtype == np.uint8 and pool.idle_bytes == 0
    k, v = kv_data(10)
    for target in ("float32", "bfloat16", "float32"):
        got, _ = asyncio.run(receive(k, v, "float32", target, chunks=(0,)))
        want = k if target == "float32" else np.array(mx.array(k).astype(mx.bfloat16).view(mx.uint16))
        assert np.array_equal(got.keys, want)
        got.release()


# ---- the decode node: its model's dtype, its reservation, and an answer equal to MLX alone ----

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{name: folder}: a tiny random llama as float32 HF, converted by mlx-lm to bf16, and to 4-bit over bf16."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("kvdtype")
    hf = tiny_models.build("llama", root / "hf")
    convert(str(hf), mlx_path=str(root / "bf16"), dtype="bfloat16")
    convert(str(hf), mlx_path=str(root / "q4"), dtype="bfloat16", quantize=True, q_bits=4)
    return {"float32": hf, "bfloat16": root / "bf16", "q4": root / "q4"}


def test_the_model_decides_the_kv_dtype_not_its_first_parameter(converted):
    """A 4-bit model's first parameter is uint32 (what bridged KV used to be cast to); its KV is its scales' dtype.
    mlx-lm's convert --dtype leaves config.json's torch_dtype as it was, so the loaded model is the authority."""
    from backends.decode.engine import MLXModel
    from kv_bridge.fingerprint import config_kv_dtype

    for name, want in (("float32", "float32"), ("bfloat16", "bfloat16"), ("q4", "bfloat16")):
        m = MLXModel(name, str(converted[name]))
        m.load()
        assert m.kv_dtype == want and m.dtype == getattr(mx, want), name
    assert config_kv_dtype(converted["bfloat16"]) == "float32"  # hence the warning at load, and the measurement


def mlx_alone(folder, ids: list[int], steps: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """MLX's own prefill of ids[:-1] (K, V widened to float32: exact for bf16) and its greedy tokens after ids."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import cache_kv

    model, _ = load(str(folder))
    cache = make_prompt_cache(model)
    model(mx.array(ids[:-1])[None], cache=cache)
    k, v = cache_kv(cache, len(ids) - 1)
    out, y = [], mx.array(ids[-1:])[None]
    for _ in range(steps):
        out.append(int(mx.argmax(model(y, cache=cache)[0, -1]).item()))
        y = mx.array([[out[-1]]])
    return out, k, v


@pytest.mark.parametrize("name", ["bfloat16", "q4"])
def test_decode_node_reserves_bf16_and_answers_as_mlx_alone(converted, name, empty_config):
    """A bf16 model's decode node reserves bf16 bytes (a cap that holds the prompt in bf16 but not in float32
    accepts it), receives MLX's own KV over a float32 wire, and decodes what MLX alone decodes, token for token."""
    from backends.common import node_app
    from backends.decode.node import DecodeService
    from kv_bridge.config.settings import Settings
    from kv_bridge.fingerprint import kv_spec

    folder, steps = converted[name], 6
    ids = list(range(100, 160))
    want, k, v = mlx_alone(folder, ids, steps)
    n, spec = len(ids) - 1, kv_spec(folder)
    per_token = 2 * spec["num_layers"] * spec["num_kv_heads"] * spec["head_dim"] * 2
    port, kv_port = free_port(), free_port()
    settings = Settings(gateway={"host": "127.0.0.1", "port": free_port()}, prefill={}, decode={},
                        kv={"max_inflight_bytes": n * per_token},  # float32 would need twice this: 429
                        nodes=[{"name": "decode-0", "role": "decode", "host": "127.0.0.1", "port": port,
                                "kv_port": kv_port}],
                        models=[{"id": "tiny", "path": str(folder), "prefill": [], "decode": ["decode-0"]}])

    async def go():
        svc = DecodeService(settings, settings.node("decode-0"))
        app = node_app(svc.health, svc.start, svc.stop)
        app.router.add_post("/v1/generate", svc.generate)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            rid = uuid.uuid4().hex
            body = {"request_id": rid, "model": "tiny", "token_ids": ids, "max_tokens": steps, "temperature": 0,
                    "kv": {"tokens": n}}
            async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/v1/generate", json=body) as r:
                assert r.status == 200, await r.text()
                assert json.loads(await r.content.readline())["type"] == "accepted"
                assert svc.models["tiny"].kv_dtype == "bfloat16"
                assert svc.receiver.inflight_bytes == n * per_token  # half of float32's
                await asyncio.to_thread(send_f32, kv_port, rid, spec, k, v)
                return [json.loads(ln) async for ln in r.content]
        finally:
            await runner.cleanup()
    lines = asyncio.run(go())
    assert lines[-1]["type"] == "done" and lines[-1]["kv_tokens"] == n, lines[-1]
    assert [ln["token_id"] for ln in lines if ln["type"] == "token"] == want


def send_f32(port: int, tid: str, spec: dict, k: np.ndarray, v: np.ndarray) -> None:
    s = KVSender(max_bytes=64 << 20)
    n = k.shape[2]
    s.open(wire.StreamHeader(transfer_id=tid, fingerprint=spec["fingerprint"], num_layers=spec["num_layers"],
                             num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"], dtype="float32",
                             start=0, num_tokens=n), "127.0.0.1", port)
    for layer in range(k.shape[0]):
        s.send_layer(tid, layer, 0, np.ascontiguousarray(k[layer]), np.ascontiguousarray(v[layer]))
    s.close(tid)
    s.flush()
    s.shutdown()
