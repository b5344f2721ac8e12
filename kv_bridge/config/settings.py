"""config.toml's whole schema, read through pydantic-settings, and `load_config`.

Precedence: init kwargs > `DISAGG_*` environment (nested with `__`) > the TOML file > defaults.
"""

from __future__ import annotations

import os

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, TomlConfigSettingsSource

from kv_bridge.config.auth import AuthConfig
from kv_bridge.config.gateway import GatewayConfig
from kv_bridge.config.models import ModelRoute
from kv_bridge.config.nodes import DecodeConfig, KVConfig, NodeConfig, PrefillConfig
from kv_bridge.config.site import SiteConfig
from kv_bridge.config.source import ConfigError, config_path
from kv_bridge.fidelity import FidelityConfig


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DISAGG_", env_nested_delimiter="__", extra="forbid")

    gateway: GatewayConfig = GatewayConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    kv: KVConfig = KVConfig()
    auth: AuthConfig = AuthConfig()
    fidelity: FidelityConfig = FidelityConfig()  # the KV canary (kv_bridge/fidelity.py)
    site: SiteConfig = SiteConfig()  # `make site` only (kv_bridge/config/site.py)
    nodes: list[NodeConfig] = Field(default_factory=list)
    models: list[ModelRoute] = Field(default_factory=list)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        toml = TomlConfigSettingsSource(settings_cls, toml_file=config_path())
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
        for o in self.fidelity.override:  # a typo must not leave the pair it meant unguarded (or ruled out)
            for want, known, what in ((o.model, [m.id for m in self.models], "model id"),
                                      (o.prefill, [n for n in names if by_name[n].role == "prefill"], "prefill node"),
                                      (o.decode, [n for n in names if by_name[n].role == "decode"], "decode node")):
                if want is not None and want not in known:
                    raise ValueError(f"[[fidelity.override]] names {what} {want!r}, which config.toml does not have; "
                                     f"known: {known}")
        return self

    def node(self, name: str) -> NodeConfig:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"no node named {name!r} in config.toml; known: {[n.name for n in self.nodes]}")

    def route(self, model_id: str) -> ModelRoute | None:
        """The model a client names by its id or one of its aliases."""
        return next((m for m in self.models if model_id in m.names), None)


def load_config(path: str | os.PathLike | None = None) -> Settings:
    """Load and validate settings; raise ConfigError naming the bad field and how to fix it."""
    if path is not None:
        os.environ["DISAGG_CONFIG"] = str(path)
    cfg_path = config_path()
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
