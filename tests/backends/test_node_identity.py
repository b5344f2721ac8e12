"""Who answers a node's /health: a boot id new with each process (each node app), and per model a digest of what
shapes its KV, which moves with any of its fields (the gateway re-verifies a pair's KV when either moves)."""

from __future__ import annotations

import asyncio

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


def test_a_decode_nodes_eagle3_head_moves_its_kv_identity_and_its_kv_reservation(tmp_path, empty_config):
    """The head's prompt KV rides the model's stream: a changed head is another identity (the gateway re-verifies
    the pair), and with prefill_draft_path set the node reserves the head's layer beside the model's."""
    import json

    from backends.decode.node import DecodeService
    from backends.decode.speculative.eagle3 import untrained_eagle3
    from backends.decode.speculative.learned_load import target_from_config
    from kv_bridge.config.settings import Settings

    folder = tiny_models.build("llama", tmp_path / "tiny")
    target = target_from_config(json.loads((folder / "config.json").read_text()))

    def service(head: str | None, prefill_head: bool = False, method: str = "eagle3") -> DecodeService:
        model = {"id": "tiny", "path": str(folder), "prefill": [], "decode": ["decode-0"]}
        if head:
            model["speculative"] = {"method": method, "draft_path": head}
        if prefill_head:
            model["prefill_draft_path"] = head
        s = Settings(gateway={"host": "127.0.0.1", "port": free_port()}, prefill={}, decode={}, kv={},
                     nodes=[{"name": "decode-0", "role": "decode", "port": free_port(), "kv_port": free_port()}],
                     models=[model])
        return DecodeService(s, s.node("decode-0"))

    a = untrained_eagle3(target, str(tmp_path / "a"), seed=0)
    b = untrained_eagle3(target, str(tmp_path / "b"), seed=1)
    ids = {h: service(h).kv_identity(service(h).models["tiny"]) for h in (None, a, b)}
    assert ids[None]["draft_head"] is None and ids[a]["draft_head"] and ids[a]["draft_head"] != ids[b]["draft_head"]
    assert len({i["digest"] for i in ids.values()}) == 3
    svc = service(a)
    assert "draft_layers" not in svc.models["tiny"].spec  # no prefill head: nothing more arrives
    svc = service(a, prefill_head=True)
    spec = svc.models["tiny"].spec
    assert spec["draft_layers"] == 1

    async def reserve() -> int:  # a transfer belongs to the node's event loop
        svc.receiver.expect("r", 11, spec, dtype="float32")
        return svc.receiver.inflight_bytes
    per_layer = 11 * 2 * spec["num_kv_heads"] * spec["head_dim"] * 4  # 11 tokens of KV, float32
    assert asyncio.run(reserve()) == (spec["num_layers"] + 1) * per_layer
    from backends.decode.speculative.dflash import untrained_dflash

    dflash = untrained_dflash(target, str(tmp_path / "df"), layers=3)  # its layers, read from this node's copy
    svc = service(dflash, prefill_head=True, method="dflash")
    assert svc.models["tiny"].spec["draft_layers"] == 3
    assert svc.kv_identity(svc.models["tiny"])["draft_head"]  # a DFlash drafter moves the identity too


def test_a_prefill_nodes_eagle3_head_moves_its_kv_identity(tmp_path, empty_config):
    """The prefill node runs the head and sends its prompt KV as one more layer: its identity names the head too."""
    import json

    from backends.decode.speculative.eagle3 import untrained_eagle3
    from backends.decode.speculative.learned_load import target_from_config
    from backends.prefill.node import PrefillService
    from kv_bridge.config.settings import Settings

    folder = tiny_models.build("llama", tmp_path / "tiny")
    target = target_from_config(json.loads((folder / "config.json").read_text()))

    def identity(head: str | None) -> dict:
        model = {"id": "tiny", "path": str(folder), "prefill": ["prefill-0"], "decode": ["decode-0"]}
        if head:
            model["prefill_draft_path"] = head
        s = Settings(gateway={"host": "127.0.0.1", "port": free_port()}, prefill={}, decode={}, kv={},
                     nodes=[{"name": "prefill-0", "role": "prefill", "port": free_port()},
                            {"name": "decode-0", "role": "decode", "port": free_port(), "kv_port": free_port()}],
                     models=[model])
        return PrefillService(s, s.node("prefill-0")).kv_identity("tiny")

    none, a, b = identity(None), *(identity(untrained_eagle3(target, str(tmp_path / n), seed=i))
                                   for i, n in enumerate("ab"))
    assert none["draft_head"] is None and a["draft_head"] and a["draft_head"] != b["draft_head"]
    assert len({none["digest"], a["digest"], b["digest"]}) == 3
