"""Who answers a node's /health: a boot id new with each process (each node app), and per model a digest of what
shapes its KV, which moves with any of its fields (the gateway re-verifies a pair's KV when either moves)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from backends.common import kv_identity, machine, node_app, project_version
from tests.support import tiny_models
from tests.support.stack import free_port


async def _noop(app: web.Application) -> None:
    return None


async def _boot_id(app: web.Application) -> str:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as http:
            ids = set()
            for _ in range(2):
                async with http.get(f"http://127.0.0.1:{port}/health") as r:
                    body = await r.json()
                    assert r.status == 200 and body["status"] == "ok" and body["role"] == "decode"
                    ids.add(body["boot_id"])
            (one,) = ids  # the same process answers the same id every time
            return one
    finally:
        await runner.cleanup()


async def test_health_carries_a_boot_id_new_with_each_process():
    first = await _boot_id(node_app(lambda: {"role": "decode"}, _noop, _noop))
    second = await _boot_id(node_app(lambda: {"role": "decode"}, _noop, _noop))
    assert len(first) == 32 and first != second


def test_the_kv_digest_moves_with_any_field_and_not_with_their_order():
    base = {"kv_dtype": "float32", "kv_bits": None, "fingerprint": "ab", "versions": {"mlx": "0.32.4"}}
    same = kv_identity(dict(reversed(list(base.items()))))
    assert same == kv_identity(base) and same["kv_dtype"] == "float32" and len(same["digest"]) == 16
    for field, other in (("kv_dtype", "bfloat16"), ("kv_bits", 4), ("fingerprint", "cd"),
                         ("versions", {"mlx": "0.33.0"})):
        assert kv_identity({**base, field: other})["digest"] != same["digest"], field
    assert machine().split()[0]  # the architecture at least


def test_a_decode_node_reports_its_models_kv_identity(tmp_path, empty_config):
    from backends.decode.node import DecodeService
    from kv_bridge.config.settings import Settings

    def service(**decode) -> DecodeService:
        s = Settings(gateway={"host": "127.0.0.1", "port": free_port()}, prefill={}, decode=decode, kv={},
                     nodes=[{"name": "decode-0", "role": "decode", "port": free_port(), "kv_port": free_port()}],
                     models=[{"id": "tiny", "path": str(folder), "prefill": [], "decode": ["decode-0"]}])
        svc = DecodeService(s, s.node("decode-0"))
        svc.models["tiny"].load()
        return svc

    folder = tiny_models.build("llama", tmp_path / "tiny")
    plain = service().health()["kv_identity"]["tiny"]
    assert plain["kv_dtype"] == "float32" and plain["kv_bits"] is None and plain["fingerprint"]
    assert plain["versions"]["mlx"] != "-"
    # issue #50: a restart keeps the identity only when the attention backend and the project's code are the same
    assert plain["attention_backend"].startswith("mlx Device(") and plain["weights"] == {"scheme": "none", "bits": None}
    assert plain["project"].split()[1] == project_version().split()[1] and len(plain["project"].split()[1]) == 12
    quantized = service(kv_bits=8).health()["kv_identity"]["tiny"]  # another KV: another digest
    assert quantized["kv_bits"] == 8 and quantized["digest"] != plain["digest"]
