"""What both node services share: the error tree and its JSON translation, node auth, /health (with the process's
boot id and the KV identity helper the gateway's fidelity check compares), and start-up."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import platform
import uuid
from importlib import metadata
from pathlib import Path
from collections.abc import Awaitable, Callable

from aiohttp import web

from backends.host_cpu import cpu_flags, read_cpuinfo
from kv_bridge.config.nodes import NodeConfig
from kv_bridge.config.settings import Settings

log = logging.getLogger(__name__)


class NodeError(Exception):
    """An error a node reports to its caller as {"error": {"message", "type", "code"}} with `status`."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.headers = headers or {}


def bad_request(message: str) -> NodeError:
    return NodeError(400, message, "invalid_request")


def error_response(status: int, message: str, code: str | None = None, headers: dict | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status,
                             headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except NodeError as e:
        return error_response(e.status, str(e), e.code, e.headers)
    except (web.HTTPException, ConnectionResetError):  # a client that left gets no answer, and is no failure
        raise
    except Exception as e:  # the one boundary where anything else becomes a 500 with a message
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"{type(e).__name__}: {e}")


def node_token(settings: Settings, node: NodeConfig) -> str | None:
    """The Bearer token this node demands (None: open). Raises ConfigError for a node reachable from other hosts
    without a node secret (unless auth.insecure_nodes), or for an unreadable secret file."""
    settings.auth.check_node_exposure(node)
    return settings.auth.node_token()


def open_paths(settings: Settings) -> tuple[str, ...]:
    """Routes a node serves without its credential: /metrics for Prometheus, unless auth.protect_metrics."""
    return () if settings.auth.protect_metrics else ("/metrics",)


def auth_middleware(token: str, open_paths: tuple[str, ...] = ()):
    """Every route but `open_paths`, /health included, needs `Authorization: Bearer <token>`: the gateway sends it
    on every call."""
    want = hashlib.sha256(token.encode()).digest()

    @web.middleware
    async def node_auth(request: web.Request, handler):
        if request.method == "GET" and request.path in open_paths:
            return await handler(request)
        scheme, _, got = request.headers.get("Authorization", "").partition(" ")
        # compare digests: equal lengths, constant time, whatever the caller sent
        got_digest = hashlib.sha256(got.strip().encode(errors="replace")).digest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(got_digest, want):
            resp = error_response(401, "this node needs the gateway's node credential: set the same auth.node_secret "
                                  "on the gateway and every node", "unauthorized")
            resp.headers["WWW-Authenticate"] = 'Bearer realm="disagg-node"'
            return resp
        return await handler(request)

    return node_auth


async def json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def kv_identity(fields: dict) -> dict:
    """What shapes a node's KV of one model (dtypes, parallelism, layout inputs, fingerprint, wire dtype, versions),
    with their digest: {"digest": 16 hex of sha256 over the fields' canonical JSON, **fields}. The gateway verifies
    a pair's KV again before it carries traffic when the digest changes (gateway/cluster/fidelity.py)."""
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()
    return {"digest": hashlib.sha256(blob).hexdigest()[:16], **fields}


_CODE: list[str] = []  # the KV path's code digest, once per process


def project_version() -> str:
    """This project's version and a digest of the KV path's code (kv_bridge/): an upgrade that changes how KV is laid
    out, sent or rebuilt moves a node's KV identity even when the package version does not."""
    if not _CODE:
        import kv_bridge

        root = Path(kv_bridge.__file__).resolve().parent
        h = hashlib.sha256()
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
        _CODE.append(h.hexdigest()[:12])
    try:
        version = metadata.version("disagg")
    except metadata.PackageNotFoundError:
        version = "-"
    return f"{version} {_CODE[0]}"


def versions(*dists: str) -> dict[str, str]:
    """Installed versions of `dists` (kernels change with them); "-" for one not installed."""
    out = {}
    for d in dists:
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = "-"
    return out


# CPU features a kernel (and so a KV layout or its rounding) is chosen by: vLLM's CPU attention ISA, bf16 paths.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> str:
    """The architecture and, where /proc/cpuinfo says, the CPU features above: `x86_64 avx2,avx512f`."""
    flags = cpu_flags(read_cpuinfo() or "")  # none on macOS: the architecture says it (arm64)
    return " ".join([platform.machine(), ",".join(f for f in _CPU_FLAGS if f in flags)]).strip()


def node_app(health: Callable[[], dict], on_start: Callable[[web.Application], Awaitable[None]],
             on_stop: Callable[[web.Application], Awaitable[None]], token: str | None = None,
             open_paths: tuple[str, ...] = ()) -> web.Application:
    """The node's aiohttp app; with `token` (node_token) every route but `open_paths` refuses callers without it.
    Its /health carries `boot_id`, new each time the process starts: the gateway tells a restarted node by it."""
    middlewares = [error_middleware] if token is None else [auth_middleware(token, open_paths), error_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=64 << 20)
    boot_id = uuid.uuid4().hex

    async def health_handler(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "boot_id": boot_id, **health()})

    app.router.add_get("/health", health_handler)
    app.on_startup.append(on_start)
    app.on_shutdown.append(on_stop)
    return app


def run_app(app: web.Application, node: NodeConfig, **kw) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {node.name} %(levelname)s %(name)s: %(message)s")
    web.run_app(app, host=node.host, port=node.port, print=lambda *a: log.info("%s listening on %s", node.name, node.url),
                shutdown_timeout=5, **kw)
