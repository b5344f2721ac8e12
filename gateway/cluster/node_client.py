"""The gateway's HTTP client for its nodes: owns the shared session and the timeouts of every node call
(open a decode stream, prefill, abort a transfer, health)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp

from gateway.cluster.nodes import NodePool, NodeState

log = logging.getLogger("gateway.cluster.node_client")

CONNECT_TIMEOUT_S = 5.0


async def error_text(resp: aiohttp.ClientResponse) -> str:
    """A node's error message from `{"error": {"message": ...}}`, or its raw body."""
    raw = await resp.text(errors="replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return str(json.loads(raw)["error"]["message"])
    return raw[:500] or f"HTTP {resp.status}"


class NodeClient:
    """Node calls over one session; `request_timeout_s` bounds a whole generation or prefill call."""

    def __init__(self, session: aiohttp.ClientSession, pool: NodePool, request_timeout_s: float) -> None:
        self.session, self.pool = session, pool
        self.stream_timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=CONNECT_TIMEOUT_S)

    async def open_generate(self, node: NodeState, payload: dict) -> aiohttp.ClientResponse:
        """POST /v1/generate; the caller reads the NDJSON stream and releases the response."""
        return await self.session.post(f"{node.url}/v1/generate", json=payload, timeout=self.stream_timeout)

    def prefill(self, node: NodeState, payload: dict):
        """POST /v1/prefill, as an `async with` context."""
        return self.session.post(f"{node.url}/v1/prefill", json=payload, timeout=self.stream_timeout)

    async def abort_transfer(self, decode: NodeState, request_id: str) -> None:
        """Tell the decode node the KV of `request_id` will not come: it prefills locally (kv_aborted)."""
        url = f"{decode.url}/v1/transfers/{request_id}/abort"
        try:
            async with self.session.post(url, timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)) as resp:
                await resp.read()
                if resp.status != 200:
                    log.warning("abort of %s on %s answered HTTP %s", request_id, decode.name, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("abort of %s on %s failed: %s", request_id, decode.name, e)

    async def check(self, node: NodeState) -> None:
        """Health-check one node now (a broken stream marks a dead node down before the next poll)."""
        await self.pool.check(self.session, node)
