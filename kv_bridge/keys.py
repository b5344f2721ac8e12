"""Checks on API keys, node secrets and listen addresses; config.py's validators use them (no settings here)."""

from __future__ import annotations

import ipaddress

MIN_SECRET_CHARS = 16
GEN_SECRET = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name (or a wildcard such as 0.0.0.0, which is not loopback either)


def check_key(key: str, where: str, exc: type[Exception] = ValueError) -> str:
    if not key or any(c.isspace() for c in key) or not key.isprintable():
        raise exc(f"{where}: an API key must be non-empty printable text without spaces")
    return key


def check_secret(secret: str, where: str, exc: type[Exception] = ValueError) -> str:
    if len(secret) < MIN_SECRET_CHARS:
        raise exc(f"{where} is shorter than {MIN_SECRET_CHARS} characters; make one with {GEN_SECRET}")
    return secret
