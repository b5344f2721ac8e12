"""config.toml schema shared by every role, read through pydantic-settings.

Precedence: init kwargs > `DISAGG_*` environment (nested with `__`) > the TOML file > defaults.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

DEFAULT_CONFIG = "config.toml"


class ConfigError(ValueError):
    """config.toml (or a DISAGG_* override) is invalid; the message names the field and the fix."""


class NodeConfig(BaseModel):
    name: str
    role: Literal["prefill", "decode"]
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    kv_port: int | None = Field(default=None, ge=1, le=65535, description="decode only: KV receiver port")

    @model_validator(mode="after")
    def _kv_port(self) -> "NodeConfig":
        if self.role == "decode" and self.kv_port is None:
            raise ValueError(f"decode node {self.name!r} needs kv_port (the TCP port its KV receiver listens on)")
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class ModelRoute(BaseModel):
    id: str = Field(description="model id clients send, e.g. smollm2:135m")
    path: str = Field(description="HF folder with config.json, weights and tokenizer (same files on every node)")
    prefill: list[str] = Field(default_factory=list, description="names of prefill nodes serving this model")
    decode: list[str] = Field(min_length=1, description="names of decode nodes serving this model")
    max_model_len: int = Field(default=4096, ge=16)
    min_disagg_tokens: int = Field(default=32, ge=1, description="prompts shorter than this prefill on decode")


class GatewayConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    request_timeout_s: float = Field(default=600.0, gt=0)
    health_interval_s: float = Field(default=2.0, gt=0)


class PrefillConfig(BaseModel):
    dtype: str = Field(default="auto", description="vLLM model dtype; float32 makes bridged KV match MLX tightly")
    kv_cache_space_gib: int = Field(default=1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU hosts")
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    enforce_eager: bool = True
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        default="auto", description="vLLM KV cache dtype; fp8 caches cross the wire as fp8 with their scales")
    max_num_batched_tokens: int | None = Field(default=None, ge=16)


class DecodeConfig(BaseModel):
    kv_timeout_s: float = Field(default=30.0, gt=0, description="wait this long for KV, then prefill locally")


class KVConfig(BaseModel):
    max_tokens: int = Field(default=131072, ge=1, description="largest token count one transfer may declare")
    max_frame_bytes: int = Field(default=256 << 20, ge=1024, description="largest KV frame payload accepted")
    max_transfer_bytes: int = Field(default=8 << 30, ge=1024, description="largest total KV one transfer may declare")
    queue_frames: int = Field(default=256, ge=1, description="sender queue bound (frames) before the forward waits")
    connect_timeout_s: float = Field(default=5.0, gt=0)
    wire_dtype: Literal["auto", "float8_e4m3"] = Field(
        default="auto", description="auto: the cache's own dtype; float8_e4m3: scaled fp8 on the wire (1/2 of bf16)")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DISAGG_", env_nested_delimiter="__", extra="forbid")

    gateway: GatewayConfig = GatewayConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    kv: KVConfig = KVConfig()
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
        return next((m for m in self.models if m.id == model_id), None)


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


def resolve_model_path(route: ModelRoute, base: Path | None = None) -> Path:
    """Model paths in config.toml are relative to the config file's folder."""
    p = Path(route.path)
    if not p.is_absolute():
        p = (base or _config_path().resolve().parent) / p
    return p
