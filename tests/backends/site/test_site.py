"""The site launcher's parts without engines: examples/site-local.toml's topology (distinct loopback addresses,
a link relay per Mac, ports reused across addresses), and the link relay over real sockets (forwarding both ways,
cut and restore, a bad rate refused)."""

from __future__ import annotations

import asyncio

import pytest

from backends.site import launch as site
from backends.cli import up
from backends.site.link import Link, control_app
from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import load_config
from tests.support import ROOT

CONFIG = ROOT / "examples" / "site-local.toml"


def _site_settings():
    """site-local.toml as `make site` loads it: in a clean clone its credentials are written first."""
    site.ensure_credentials(CONFIG)
    return load_config(CONFIG)


def test_site_local_plans_every_machine_and_a_link_per_mac():
    settings = _site_settings()
    children = up.plan(settings) + site.link_children(settings)
    assert [c.name for c in children] == ["spark-0", "spark-1", "mac-0", "mac-1", "gateway", "link-mac-0",
                                          "link-mac-1"]
    hosts = {c.host for c in children if c.role in ("prefill", "decode")}
    assert len(hosts) == 4 and all(h.startswith("127.") for h in hosts)
    for mac in ("mac-0", "mac-1"):
        n = settings.node(mac)
        assert len({n.host, n.kv_host, n.kv_advertise_host}) == 3  # HTTP, KV listener and link relay apart
    assert settings.auth.kv_frame_mac and settings.auth.api_keys_file and settings.auth.node_secret_file
    assert settings.site.link_bytes_per_s and {m.id for m in settings.models} == {"smollm2:135m", "gpt-oss:tiny"}
    assert all(set(m.decode) == {"mac-0", "mac-1"} and len(m.prefill) == 1 for m in settings.models)


def test_preflight_allows_one_port_on_two_addresses_but_not_twice_on_one():
    settings = _site_settings()
    a = up.Child("a", "link", "127.0.9.1", 18301, [18301])
    b = up.Child("b", "link", "127.0.9.2", 18301, [18301])
    up.preflight(settings.model_copy(update={"models": []}), [a, b])
    with pytest.raises(up.ConfigError, match="18301 on 127.0.9.1 is used by both a and c"):
        up.preflight(settings.model_copy(update={"models": []}), [a, b, up.Child("c", "link", "127.0.9.1", 1, [18301])])


def test_ensure_credentials_writes_missing_files_once(tmp_path):
    cfg = tmp_path / "site.toml"
    cfg.write_text('[auth]\napi_keys_file = "state/api-keys"\nnode_secret_file = "state/node-secret"\n')
    site.ensure_credentials(cfg)
    keys, secret = (tmp_path / "state/api-keys").read_text(), (tmp_path / "state/node-secret").read_text()
    assert (tmp_path / "state/node-secret").stat().st_mode & 0o077 == 0
    site.ensure_credentials(cfg)  # a second start keeps what clients already hold
    assert (tmp_path / "state/api-keys").read_text() == keys and (tmp_path / "state/node-secret").read_text() == secret
    settings = load_config(cfg)
    assert settings.auth.client_keys() == [keys.strip()] and settings.auth.node_token()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest.fixture
async def relay():
    """An echo server as the KV receiver, a Link in front of it, and the link's control app."""
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = echo.sockets[0].getsockname()[1]
    node = NodeConfig(name="mac-0", role="decode", port=1, kv_host="127.0.0.1", kv_port=port)
    link = Link(node, rate=None)
    front = await asyncio.start_server(link.handle, "127.0.0.1", 0)
    from aiohttp.test_utils import TestClient, TestServer

    client = TestClient(TestServer(control_app(link)))
    await client.start_server()
    yield link, front.sockets[0].getsockname()[1], client
    await client.close()
    front.close()
    echo.close()


async def _roundtrip(port: int, payload: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(payload)
    await w.drain()
    got = await asyncio.wait_for(r.readexactly(len(payload)), 10)
    w.close()
    return got


async def test_link_forwards_both_ways_and_counts_bytes(relay):
    link, port, client = relay
    payload = bytes(range(256)) * 1000
    assert await _roundtrip(port, payload) == payload
    state = await (await client.get("/health")).json()
    assert state["up"] and state["bytes"] == len(payload)


async def test_cut_drops_live_connections_and_refuses_new_ones_until_restored(relay):
    link, port, client = relay
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"x")
    await w.drain()
    assert await asyncio.wait_for(r.readexactly(1), 10) == b"x"
    cut = await (await client.post("/cut")).json()
    assert cut["dropped"] == 1 and not cut["up"]
    assert await asyncio.wait_for(r.read(), 10) == b""  # the live transfer's connection is gone
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
        await _roundtrip(port, b"during the cut")
    assert (await (await client.post("/restore")).json())["up"]
    assert await _roundtrip(port, b"after") == b"after"


async def test_rate_control_refuses_nonsense(relay):
    link, _, client = relay
    assert (await client.post("/rate?bytes_per_s=-1")).status == 400
    assert (await client.post("/rate?bytes_per_s=5e6")).status == 200 and link.pacer.rate == 5e6


def test_the_rehearsal_prefills_float32_where_the_cpu_lacks_bf16(monkeypatch, capsys):
    """site-local.toml asks bf16 as the lab's checkpoints are; on a CPU without native bf16 (AVX2 only) every prefill
    role is told float32 through the environment the roles inherit, and the site says why; an explicit choice stays."""
    settings = _site_settings()
    assert settings.prefill.dtype == "bfloat16"
    monkeypatch.delenv("DISAGG_PREFILL__DTYPE", raising=False)
    monkeypatch.setenv("DISAGG_CPU_BF16", "1")
    assert site.rehearsal_dtype(settings).prefill.dtype == "bfloat16" and "DISAGG_PREFILL__DTYPE" not in site.os.environ
    monkeypatch.setenv("DISAGG_CPU_BF16", "0")
    got = site.rehearsal_dtype(settings)
    assert got.prefill.dtype == "float32" and site.os.environ["DISAGG_PREFILL__DTYPE"] == "float32"
    assert "no native bf16" in capsys.readouterr().out
    assert load_config(CONFIG).prefill.dtype == "float32"  # what each role reads at start
    monkeypatch.setenv("DISAGG_PREFILL__DTYPE", "bfloat16")
    assert site.rehearsal_dtype(load_config(CONFIG)).prefill.dtype == "bfloat16"
