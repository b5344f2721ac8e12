"""The app's check before it sends anything: `/api/tags` (and `/api/ps`) on a gateway configured like the seeds' site
(examples/site-seeds.toml: its models, ids, aliases and node names; fake nodes on loopback stand in for its machines,
whose addresses get no traffic) list the models exactly as the app names them, read with the official ollama client
pointed at the gateway's Ollama port."""

from __future__ import annotations

import ollama
from aiohttp import web

from gateway.app import create_app, listen_sockets
from kv_bridge.config.settings import Settings, load_config
from tests.support import ROOT
from tests.support.fakes import MODEL_DIR, FakeDecodeNode, FakePrefillNode, free_port

SEEDS = ROOT / "examples" / "site-seeds.toml"
APP_NAMES = ["qwen3-coder:30b", "gpt-oss:120b"]  # what the lab's app sends and looks for


def seeds_on_loopback(seeds: Settings, fakes: dict) -> Settings:
    """The seeds' site with each node at its fake's loopback port and each model's tokenizer from the embedded
    model's folder; ids, aliases, routes, [gateway] and [auth] as the file has them (keys from its own folder)."""
    nodes = [{"name": n.name, "role": n.role, "host": "127.0.0.1", "port": fakes[n.name].port,
              **({"kv_port": fakes[n.name].kv_port} if n.role == "decode" else {})} for n in seeds.nodes]
    models = [{**m.model_dump(exclude={"path"}), "path": str(MODEL_DIR)} for m in seeds.models]
    gw = seeds.gateway.model_dump() | {"host": "127.0.0.1", "advertise_host": None, "port": free_port(),
                                       "ollama_port": free_port()}
    return Settings(gateway=gw, prefill={}, decode={}, kv=seeds.kv.model_dump(), fidelity={}, nodes=nodes,
                    models=models, auth={"keyless_networks": ["127.0.0.0/8"], "api_keys": ["sk-seeds-test-key"]})


async def test_tags_on_the_seeds_site_lists_the_apps_names(empty_config, monkeypatch):
    seeds = load_config(SEEDS)  # parsed only
    monkeypatch.setenv("DISAGG_CONFIG", str(empty_config))  # load_config pointed it at the seeds' file
    assert [m.id for m in seeds.models] == APP_NAMES
    decoders = [FakeDecodeNode(n.name) for n in seeds.nodes if n.role == "decode"]
    prefills = [FakePrefillNode(n.name, decoders) for n in seeds.nodes if n.role == "prefill"]
    for node in [*decoders, *prefills]:
        await node.start()
    settings = seeds_on_loopback(seeds, {n.name: n for n in [*decoders, *prefills]})
    runner = web.AppRunner(create_app(settings), shutdown_timeout=0.1)
    await runner.setup()
    socks = listen_sockets(settings)
    for sock in socks:
        await web.SockSite(runner, sock).start()
    try:
        client = ollama.AsyncClient(host=f"127.0.0.1:{settings.gateway.ollama_port}")  # as OLLAMA_HOST would say
        names = [m.model for m in (await client.list()).models]
        for name in APP_NAMES:
            assert names.count(name) == 1, names  # exactly as the app spells it, once
        assert set(names) == {n for m in seeds.models for n in m.names}  # and only the config's ids and aliases
        loaded = [m.model for m in (await client.ps()).models]
        assert loaded == APP_NAMES
        # the gateway's own port answers the same list
        own = ollama.AsyncClient(host=f"127.0.0.1:{settings.gateway.port}")
        assert [m.model for m in (await own.list()).models] == names
    finally:
        await runner.cleanup()
        for node in [*decoders, *prefills]:
            await node.stop()
