"""`python -m gateway [--config PATH] [--probe]`: load config.toml and serve the gateway, or (`--probe`, the compose
file's health check) GET /health on every port the config has it listen on."""

from __future__ import annotations

import argparse
import sys

from kv_bridge.config.settings import load_config
from kv_bridge.config.source import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description="disagg OpenAI-compatible gateway")
    parser.add_argument("--config", help="config.toml path (default: $DISAGG_CONFIG or ./config.toml)")
    parser.add_argument("--probe", action="store_true", help="exit 0 when /health answers 200 on every port the "
                        "config listens on (a container health check), 1 otherwise")
    args = parser.parse_args(argv)
    try:
        settings = load_config(args.config)
        if args.probe:
            return probe(settings)
        from .app import serve  # after config, so `--help` and config errors stay fast

        serve(settings)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def probe(settings) -> int:
    """GET /health on each listen address from this machine (loopback for a wildcard host), with a key if one is set."""
    import urllib.request

    gw, keys = settings.gateway, settings.auth.client_keys()
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys and settings.auth.protect_health else {}
    for host, port in gw.listen():
        host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/health"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=3) as r:
                if r.status != 200:
                    raise OSError(f"HTTP {r.status}")
        except OSError as e:
            print(f"{url}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
