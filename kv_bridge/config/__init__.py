"""config.toml's schema, one module per thing it configures: settings (the whole file, `load_config`), source
(where it is read from, ConfigError), nodes, models, auth, gateway, machines, speculative, site, fidelity (the KV
canary's schedule and overrides). Light imports only (pydantic, pydantic-settings, kv_bridge's root contracts): every
role, the gateway included, reads it."""
