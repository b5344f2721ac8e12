"""`python -m gateway [--config PATH]`: load config.toml and serve the gateway."""

from __future__ import annotations

import argparse
import sys

from kv_bridge.config.settings import load_config
from kv_bridge.config.source import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description="disagg OpenAI-compatible gateway")
    parser.add_argument("--config", help="config.toml path (default: $DISAGG_CONFIG or ./config.toml)")
    args = parser.parse_args(argv)
    try:
        settings = load_config(args.config)
        from .app import serve  # after config, so `--help` and config errors stay fast

        serve(settings)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
