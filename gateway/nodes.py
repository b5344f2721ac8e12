"""Node registry: up/down state from polling each node's GET /health, in-flight counts, and node choice."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Iterable

import aiohttp

from kv_bridge.config import ModelRoute, NodeConfig

from .metrics import Metrics

log = logging.getLogger("gateway.nodes")


@dataclass
class NodeState:
    config: NodeConfig
    up: bool = False  # down until the first health check answers ok
    inflight: int = 0
    reason: str | None = "not checked yet"

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def role(self) -> str:
        return self.config.role

    @property
    def url(self) -> str:
        return self.config.url

    def snapshot(self) -> dict:
        out = {"name": self.name, "role": self.role, "up": self.up, "inflight": self.inflight}
        if not self.up:
            out["reason"] = self.reason
        return out


class NodePool:
    def __init__(self, nodes: Iterable[NodeConfig], metrics: Metrics, health_interval_s: float) -> None:
        self.nodes = {n.name: NodeState(n) for n in nodes}
        self._metrics = metrics
        self.interval = health_interval_s
        # Short enough that one hung node cannot stall the poll loop for long; local nodes answer in ms.
        self.timeout = max(0.5, min(2.0, health_interval_s))
        for node in self.nodes.values():
            metrics.node_up.labels(node.name, node.role).set(0)

    def mark(self, node: NodeState, up: bool, reason: str | None = None) -> None:
        if node.up != up:
            if up:
                log.info("node %s (%s) is up", node.name, node.role)
            else:
                log.warning("node %s (%s) is down: %s", node.name, node.role, reason)
        node.up = up
        node.reason = None if up else reason
        self._metrics.node_up.labels(node.name, node.role).set(1 if up else 0)

    def healthy(self, names: Iterable[str]) -> list[NodeState]:
        return [self.nodes[n] for n in names if n in self.nodes and self.nodes[n].up]

    def pick(self, names: list[str], exclude: Iterable[str] = ()) -> NodeState | None:
        """The healthy node with the fewest requests in flight; ties go to the earlier one in the route's list."""
        skip = set(exclude)
        candidates = [n for n in self.healthy(names) if n.name not in skip]
        return min(candidates, key=lambda n: n.inflight, default=None)

    def serving(self, routes: Iterable[ModelRoute]) -> bool:
        return all(self.healthy(r.decode) for r in routes)

    def snapshot(self) -> list[dict]:
        return [n.snapshot() for n in self.nodes.values()]

    async def check(self, session: aiohttp.ClientSession, node: NodeState) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout)
            async with session.get(f"{node.url}/health", timeout=timeout) as resp:
                body = await resp.json(content_type=None) if resp.status == 200 else None
                if resp.status != 200:
                    self.mark(node, False, f"/health answered HTTP {resp.status}")
                elif not isinstance(body, dict) or body.get("status") != "ok":
                    self.mark(node, False, "/health did not say status ok")
                elif body.get("role", node.role) != node.role:
                    self.mark(node, False, f"node says role {body.get('role')!r}, config.toml says {node.role!r}")
                else:
                    self.mark(node, True)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            self.mark(node, False, f"/health failed: {type(e).__name__}: {e}")

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, n) for n in self.nodes.values()))

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Poll forever; the app cancels this task on shutdown."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll_once(session)
            except Exception:  # a bug here must not silently stop health tracking
                log.exception("health poll failed")
