"""`[auth]`: client API keys (gateway) and the node secret (gateway <-> nodes, prefill -> decode KV); see
docs/security.md."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, Field, IPvAnyNetwork, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from kv_bridge.config.source import ConfigError, read_secret_file
from kv_bridge.keys import GEN_SECRET, check_key, check_secret, is_loopback

if TYPE_CHECKING:
    from kv_bridge.config.nodes import NodeConfig

log = logging.getLogger(__name__)


class AuthConfig(BaseModel):
    """Client API keys (gateway) and the node secret (gateway <-> nodes, prefill -> decode KV). See docs/security.md."""

    # NoDecode: DISAGG_AUTH__API_KEYS may be one key, "k1,k2", or a JSON list (see _split)
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Bearer keys clients must send; [] = open")
    api_keys_file: Path | None = Field(default=None, description="more keys, one a line (# comments); relative to "
                                       "the config file's folder")
    operator_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Bearer keys of the site's operators: only they (or the node token, "
        "derived from the node secret) may force a KV fidelity re-check (POST /fidelity) while client keys are set; a "
        "client key may not")
    operator_keys_file: Path | None = Field(default=None, description="more operator keys, one a line; relative to "
                                            "the config file's folder")
    protect_health: bool = Field(default=False, description="/health and / need a key too (when keys are set)")
    protect_metrics: bool = Field(default=False, description="/metrics needs a key too (when keys are set)")
    node_secret: SecretStr | None = Field(default=None, description="shared by the gateway and every node")
    node_secret_file: Path | None = Field(default=None, description="the node secret, read from this file")
    kv_frame_mac: bool = Field(default=True, description="MAC every KV frame, not only the stream header")
    insecure_nodes: bool = Field(default=False, description="let a node listen beyond loopback without a secret")
    # Ollama clients send no key (the lab's app among them). The source address is the TCP peer the gateway sees:
    # run its container with host networking (docker/compose.yaml); a published port's userland proxy would show
    # every client as the Docker bridge's address (docs/security.md, "Keyless clients").
    keyless_networks: list[IPvAnyNetwork] = Field(default_factory=list, description="client networks (CIDRs) that "
                                                  "may call keyless_apis without a key; everyone else still needs one")
    keyless_apis: list[Literal["ollama", "openai", "anthropic", "all"]] = Field(
        default_factory=lambda: ["ollama"], description="the APIs keyless_networks may call without a key: "
        "\"ollama\" (/api/*), \"openai\" (/v1/*), \"anthropic\" (/v1/messages), or \"all\" (every route, the "
        "gateway's own /fidelity and vLLM's /tokenize too)")

    @field_validator("api_keys", "operator_keys", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            value = json.loads(value) if value.lstrip().startswith("[") else [k for k in value.split(",") if k.strip()]
        return [k.strip() if isinstance(k, str) else k for k in value] if isinstance(value, list) else value

    @field_validator("api_keys", "operator_keys")
    @classmethod
    def _keys(cls, keys: list[SecretStr], info) -> list[SecretStr]:
        for k in keys:
            check_key(k.get_secret_value(), f"auth.{info.field_name}")
        return keys

    @model_validator(mode="after")
    def _one_secret(self) -> "AuthConfig":
        if self.node_secret is not None and self.node_secret_file is not None:
            raise ValueError("set auth.node_secret or auth.node_secret_file, not both")
        if self.node_secret is not None:
            check_secret(self.node_secret.get_secret_value(), "auth.node_secret")
        return self

    @field_validator("keyless_networks")
    @classmethod
    def _networks(cls, nets: list) -> list:
        for net in nets:
            if net.prefixlen == 0:
                raise ValueError(f"auth.keyless_networks: {net} is every address; leave api_keys out instead (the "
                                 f"gateway is open without keys) or name the app's own network")
        return nets

    def keyless_for(self, api: str) -> list:
        """The networks that may call API `api` (a gateway/api package's name; "root" for the gateway app's own routes:
        /health, /metrics, /fidelity, /tokenize) without a key."""
        return list(self.keyless_networks) if ("all" in self.keyless_apis or api in self.keyless_apis) else []

    def keyless_allows(self, address: str | None, api: str) -> bool:
        """`address` (a TCP peer; IPv4-mapped IPv6 counts as its IPv4) lies in a network keyless for `api`."""
        nets = self.keyless_for(api)
        if not nets or not address:
            return False
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == n.version and ip in n for n in nets)

    def client_keys(self) -> list[str]:
        """Every accepted API key: api_keys plus api_keys_file's lines. Raises ConfigError for an unreadable file."""
        return _keys(self.api_keys, self.api_keys_file, "auth.api_keys_file")

    def operator_credentials(self) -> list[str]:
        """Every credential that may force a KV fidelity re-check: operator_keys, operator_keys_file's lines and the
        node token (the gateway's own, which `disagg status --recheck --config F` derives from the same secret)."""
        keys = _keys(self.operator_keys, self.operator_keys_file, "auth.operator_keys_file")
        token = self.node_token()
        return keys + ([token] if token else [])

    def secret(self) -> bytes | None:
        """The node secret, or None when nodes run open. Raises ConfigError for an unreadable or weak file."""
        if self.node_secret is not None:
            return self.node_secret.get_secret_value().encode()
        if self.node_secret_file is not None:
            text = read_secret_file(self.node_secret_file, "auth.node_secret_file").strip()
            return check_secret(text, "auth.node_secret_file's content", ConfigError).encode()
        return None

    # Purpose-bound keys: the raw secret never crosses the network, and the HTTP token (sent in clear over plain
    # HTTP) does not let its reader forge KV streams.
    def node_token(self) -> str | None:
        """The Bearer token the gateway sends and nodes demand: hex HMAC-SHA256(secret, "disagg node-http v1")."""
        s = self.secret()
        return None if s is None else hmac.new(s, b"disagg node-http v1", hashlib.sha256).hexdigest()

    def kv_key(self) -> bytes | None:
        """The key that authenticates KV streams (header and frames): HMAC-SHA256(secret, "disagg kv v1")."""
        s = self.secret()
        return None if s is None else hmac.new(s, b"disagg kv v1", hashlib.sha256).digest()

    def check_node_exposure(self, node: "NodeConfig") -> None:
        """A node reachable from other hosts needs the node secret; raise ConfigError (or warn if allowed)."""
        local = is_loopback(node.host) and (node.kv_host is None or is_loopback(node.kv_host))
        if local or self.node_secret is not None or self.node_secret_file is not None:
            return
        what = f"node {node.name!r} listens on {node.host} (HTTP {node.port}" + (
            f", KV {node.kv_port})" if node.kv_port else ")")
        if self.insecure_nodes:
            log.warning("INSECURE: %s without a node secret; any host that reaches it can use it%s", what,
                        " and inject KV" if node.kv_port else "")
            return
        raise ConfigError(f"{what}, reachable from other hosts, but no node secret is set. Set the same "
                          f"[auth] node_secret (or DISAGG_AUTH__NODE_SECRET, or node_secret_file) on the gateway "
                          f"and every node; make one with {GEN_SECRET}. To run open on a trusted network anyway, "
                          f"set auth.insecure_nodes = true")


def _keys(listed: list[SecretStr], file: Path | None, field: str) -> list[str]:
    keys = [k.get_secret_value() for k in listed]
    if file is not None:
        for n, line in enumerate(read_secret_file(file, field).splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(check_key(line, f"line {n} of {field}", ConfigError))
    return keys
