"""Where config.toml is read from (`--config`, DISAGG_CONFIG, ./config.toml), the error a bad one raises, and
files it names (secrets, keys) read relative to its folder."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CONFIG = "config.toml"


class ConfigError(ValueError):
    """config.toml (or a DISAGG_* override) is invalid; the message names the field and the fix."""


def config_path() -> Path:
    return Path(os.environ.get("DISAGG_CONFIG", DEFAULT_CONFIG))


def read_secret_file(path: Path, field: str) -> str:
    p = path if path.is_absolute() else config_path().resolve().parent / path
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{field}: cannot read {p}: {e}; fix the path (relative paths start at the config "
                          f"file's folder)") from None
