"""Client API keys on the gateway's routes, and the credential the gateway shows its nodes (docs/security.md).

No keys configured: the gateway is open, as it always was. With keys, every route needs
`Authorization: Bearer <key>` except /health and / (unless auth.protect_health) and /metrics (unless
auth.protect_metrics), and but callers from auth.keyless_networks on the APIs auth.keyless_apis names (Ollama clients
send no key); gateway.api.boundary checks it on each app and answers 401 in that app's error shape.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Callable

from aiohttp import web

from kv_bridge.config.auth import AuthConfig
from kv_bridge.config.settings import Settings
from kv_bridge.keys import is_loopback

from gateway.errors import APIError

log = logging.getLogger("gateway.auth")

# Default headers of the gateway's one ClientSession: every node call, health checks included, carries them.
NODE_HEADERS = web.AppKey("disagg_node_headers", dict)


class AuthenticationError(APIError):
    """No or a wrong API key; OpenAI answers 401 with this type and code."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class APIKeys:
    """The accepted keys, kept as SHA-256 digests and compared in constant time; `keyless(address)` says whether a
    TCP peer may call this app without one."""

    def __init__(self, keys: list[str], keyless: Callable[[str | None], bool] | None = None):
        self._digests = [_digest(k) for k in keys]
        self._keyless = keyless

    def for_api(self, cfg: AuthConfig, api: str) -> "APIKeys":
        """The same keys for API `api` (a gateway/api package's name, "root" for the gateway's own routes), letting
        in keyless the networks auth.keyless_networks names for it."""
        out = APIKeys([])
        out._digests = self._digests
        if cfg.keyless_for(api):
            out._keyless = lambda address: cfg.keyless_allows(address, api)
        return out

    def check(self, authorization: str | None, remote: str | None = None) -> str | None:
        """None when `authorization` is `Bearer <an accepted key>`, or when the peer `remote` may call keyless (any
        header then: an OpenAI client must send some key, often "ollama"); otherwise "missing" or "invalid"."""
        if self._keyless is not None and self._keyless(remote):
            return None
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return "missing"
        got = _digest(key.strip())
        ok = False
        for d in self._digests:  # every key is compared: the time taken does not say which one matched
            ok |= hmac.compare_digest(got, d)
        return None if ok else "invalid"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode(errors="replace")).digest()


def refusal(problem: str) -> AuthenticationError:
    """The 401 for a "missing" or "invalid" key; each API's error middleware writes it in that API's shape."""
    if problem == "missing":
        msg = "Missing API key: send it in an Authorization header using Bearer auth (Authorization: Bearer YOUR_KEY)"
    else:
        msg = "Incorrect API key provided"  # never echoed: it may be another service's key
    # RFC 6750: a request that carried a token learns it was invalid; one that carried none learns the scheme
    challenge = 'Bearer realm="disagg"' + ("" if problem == "missing" else ', error="invalid_token"')
    return AuthenticationError(msg, headers={"WWW-Authenticate": challenge})


def api_keys(cfg: AuthConfig) -> APIKeys | None:
    """The client keys to demand, or None when none is configured (the gateway is open).

    Raises kv_bridge.config.source.ConfigError for an unreadable api_keys_file, so a bad set-up fails at start-up.
    """
    keys = cfg.client_keys()
    return APIKeys(keys) if keys else None


class OperatorError(APIError):
    """A forced KV fidelity re-check by a caller that is not an operator (403), or too soon (429)."""

    status = 403
    type = "permission_error"
    code = "operator_only"


class OperatorKeys:
    """Who may force a KV fidelity re-check (POST /fidelity): anyone while the gateway has no client keys (it is open
    anyway: the embedded default); with them, an operator key or the node token, never a client key."""

    def __init__(self, cfg: AuthConfig, clients: APIKeys | None):
        creds = cfg.operator_credentials() if clients is not None else []
        self.open, self.clients = clients is None, clients
        self.keys = APIKeys(creds) if creds else None

    def check(self, authorization: str | None) -> None:
        """Raise the 401/403 for a caller that is not an operator."""
        if self.open:
            return
        if self.keys is None:
            raise OperatorError("POST /fidelity forces a KV re-check and needs an operator credential, and this "
                                "gateway has none: set [auth] operator_keys (or a node secret: its node token)")
        problem = self.keys.check(authorization)
        if problem is None:
            return
        if problem == "invalid" and self.clients.check(authorization) is None:
            raise OperatorError("a client key cannot force a KV fidelity re-check: send an operator key ([auth] "
                                "operator_keys) or the node token (`disagg status --recheck --config F` does)")
        raise refusal(problem)


def node_headers(cfg: AuthConfig) -> dict[str, str]:
    """What every gateway -> node request carries: the node token derived from the node secret, if one is set."""
    token = cfg.node_token()
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def warn_exposure(settings: Settings, has_keys: bool) -> None:
    """Say loudly what anyone on the network could do with this configuration (nodes refuse it themselves)."""
    gw = settings.gateway
    if not has_keys and not is_loopback(gw.host):
        log.warning("gateway listens on %s:%s without API keys: anyone who reaches it can use it; set [auth] "
                    "api_keys (or DISAGG_AUTH__API_KEYS, or api_keys_file)", gw.host, gw.ports())
    if has_keys and settings.auth.keyless_networks:
        log.info("keyless callers: %s on %s", [str(n) for n in settings.auth.keyless_networks],
                 ", ".join(settings.auth.keyless_apis))
    if settings.auth.node_secret is None and settings.auth.node_secret_file is None:
        remote = [n.name for n in settings.nodes if not is_loopback(n.host)]
        if remote:
            log.warning("nodes %s are reached over the network without a node secret: any host that reaches them "
                        "can use them or inject KV; set [auth] node_secret on the gateway and every node", remote)
