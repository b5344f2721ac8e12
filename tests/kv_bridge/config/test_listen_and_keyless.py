"""[gateway] ollama_port / advertise_host and [auth] keyless_networks / keyless_apis as the schema reads them: the
addresses the gateway listens on and clients use, and which peer may call which API without a key."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kv_bridge.config.auth import AuthConfig
from kv_bridge.config.gateway import GatewayConfig


def test_listen_addresses_and_the_url_clients_use():
    gw = GatewayConfig(host="0.0.0.0", port=8000, ollama_port=11434, advertise_host="169.254.150.103")
    assert gw.listen() == [("0.0.0.0", 8000), ("0.0.0.0", 11434)] and gw.ports() == [8000, 11434]
    assert gw.url() == "http://169.254.150.103:8000" and gw.url(ollama=True) == "http://169.254.150.103:11434"
    assert GatewayConfig(host="0.0.0.0").url(ollama=True) == "http://127.0.0.1:8000"  # no Ollama port: its own
    assert GatewayConfig(host="::1", port=9).url() == "http://[::1]:9"


def test_ollama_port_must_differ_from_port():
    with pytest.raises(ValidationError, match="ollama_port 8000 is gateway.port too"):
        GatewayConfig(port=8000, ollama_port=8000)


def test_keyless_per_api_and_network():
    auth = AuthConfig(keyless_networks=["169.254.150.0/24", "fd00::/8"], keyless_apis=["ollama"])
    assert auth.keyless_allows("169.254.150.7", "ollama")
    assert auth.keyless_allows("::ffff:169.254.150.7", "ollama")  # a dual-stack socket's view of an IPv4 peer
    assert auth.keyless_allows("fd00::5", "ollama")
    assert not auth.keyless_allows("169.254.151.7", "ollama")
    assert not auth.keyless_allows("169.254.150.7", "openai") and not auth.keyless_allows("169.254.150.7", "root")
    assert not auth.keyless_allows(None, "ollama") and not auth.keyless_allows("not-an-ip", "ollama")
    every = AuthConfig(keyless_networks=["10.0.0.0/8"], keyless_apis=["all"])
    assert all(every.keyless_allows("10.1.2.3", api) for api in ("ollama", "openai", "anthropic", "root"))
    assert AuthConfig().keyless_for("ollama") == []  # nobody by default


def test_keyless_refuses_every_address_and_unknown_apis():
    with pytest.raises(ValidationError, match="is every address"):
        AuthConfig(keyless_networks=["0.0.0.0/0"])
    with pytest.raises(ValidationError):
        AuthConfig(keyless_networks=["10.0.0.0/8"], keyless_apis=["grpc"])
    with pytest.raises(ValidationError):
        AuthConfig(keyless_networks=["10.0.0.300/8"])
