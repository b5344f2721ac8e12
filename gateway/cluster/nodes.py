"""Node registry: up/down state from polling each node's GET /health, in-flight counts, node choice (least
loaded, or the node that served a conversation's earlier turn), and the bounded prefix -> node memory behind it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

import aiohttp

from kv_bridge.config.models import ModelRoute
from kv_bridge.config.nodes import NodeConfig

from gateway.metrics import Metrics

log = logging.getLogger("gateway.cluster.nodes")
HEALTH_MISSES = 3  # health checks in a row without an answer before a node that still accepts connections is down


@dataclass
class NodeState:
    config: NodeConfig
    up: bool = False  # down until the first health check answers ok
    inflight: int = 0
    local_tokens: int = 0  # decode node: prompt tokens of its generations on the local path (the cost model's batch)
    waiting: int = 0  # decode node: generations bound for it, still queued for a prefill node's admission
    reason: str | None = "not checked yet"
    missed: int = 0  # health checks in a row that got no answer in time
    # Who answers (its /health, backends/common.py): a new boot_id is a restarted process; kv_identity per model is
    # what shapes its KV ({"digest", and the fields hashed}). The fidelity canary re-verifies a pair when either moves.
    boot_id: str | None = None
    kv_identity: dict[str, dict] = field(default_factory=dict)
    ups: int = 0  # times seen coming up: a node without a boot_id counts as new each time

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def role(self) -> str:
        return self.config.role

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def full(self) -> bool:
        limit = self.config.max_inflight
        return limit is not None and self.inflight >= limit

    def identity(self, model: str) -> tuple[str, str | None]:
        """(which process, which KV configuration of `model`) as last seen; without a boot_id, each time it came up
        is another process."""
        digest = (self.kv_identity.get(model) or {}).get("digest")
        return self.boot_id or f"up#{self.ups}", digest if isinstance(digest, str) else None

    def snapshot(self) -> dict:
        out = {"name": self.name, "role": self.role, "up": self.up, "inflight": self.inflight}
        if self.boot_id is not None:
            out["boot_id"] = self.boot_id
        if self.role == "decode":
            out["local_prefill_tokens"] = self.local_tokens
            out["waiting_for_prefill"] = self.waiting
        if self.config.max_inflight is not None:
            out["max_inflight"] = self.config.max_inflight
        if not self.up:
            out["reason"] = self.reason
        return out


class NodePool:
    def __init__(self, nodes: Iterable[NodeConfig], metrics: Metrics, health_interval_s: float) -> None:
        self.nodes = {n.name: NodeState(n) for n in nodes}
        self.metrics = metrics
        self.interval = health_interval_s
        # Short enough that one hung node cannot stall the poll loop for long; local nodes answer in ms.
        self.timeout = max(0.5, min(2.0, health_interval_s))
        for node in self.nodes.values():
            metrics.node_up.labels(node.name, node.role).set(0)

    def mark(self, node: NodeState, up: bool, reason: str | None = None) -> None:
        if node.up != up:
            node.ups += up
            if up:
                log.info("node %s (%s) is up", node.name, node.role)
            else:
                log.warning("node %s (%s) is down: %s", node.name, node.role, reason)
        node.up = up
        node.reason = None if up else reason
        self.metrics.node_up.labels(node.name, node.role).set(1 if up else 0)

    def healthy(self, names: Iterable[str]) -> list[NodeState]:
        return [self.nodes[n] for n in names if n in self.nodes and self.nodes[n].up]

    def available(self, names: Iterable[str], exclude: Iterable[str] = ()) -> list[NodeState]:
        """Healthy nodes below their in-flight limit, minus `exclude`, in the route's order."""
        skip = set(exclude)
        return [n for n in self.healthy(names) if n.name not in skip and not n.full]

    def pick(self, names: list[str], exclude: Iterable[str] = (), prefer: str | None = None,
             slack: int = 0) -> NodeState | None:
        """The available node with the fewest requests in flight (ties: the earlier in the route's list); `prefer`
        instead while it is available and has at most `slack` more in flight than that one."""
        candidates = self.available(names, exclude)
        best = min(candidates, key=lambda n: n.inflight, default=None)
        if best is not None and prefer is not None:
            favourite = next((n for n in candidates if n.name == prefer), None)
            if favourite is not None and favourite.inflight <= best.inflight + slack:
                return favourite
        return best

    def serving(self, routes: Iterable[ModelRoute]) -> bool:
        return all(self.healthy(r.decode) for r in routes)

    def snapshot(self) -> list[dict]:
        return [n.snapshot() for n in self.nodes.values()]

    async def check(self, session: aiohttp.ClientSession, node: NodeState) -> None:
        """One health check. A node that answers not-ok, or whose connection is refused or dropped, is down at once;
        one that is only slow to answer (a loaded machine: vLLM's engine and a burst's KV share the cores with the
        HTTP loop) is down after HEALTH_MISSES checks in a row without an answer, so a busy node is not mistaken for
        a dead one and its running prefills are not thrown onto local prefill."""
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
                    node.missed = 0
                    node.boot_id = body.get("boot_id") if isinstance(body.get("boot_id"), str) else None
                    ident = body.get("kv_identity")
                    node.kv_identity = ident if isinstance(ident, dict) else {}
                    self.mark(node, True)
        except asyncio.TimeoutError:
            node.missed += 1
            if node.missed >= HEALTH_MISSES or not node.up:
                self.mark(node, False, f"/health did not answer within {self.timeout:.1f}s, "
                                       f"{node.missed} times in a row")
        except (aiohttp.ClientError, ValueError) as e:
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


class PrefixAffinity:
    """Which decode node served a prompt prefix, so a conversation's next turn (whose prompt starts with the earlier
    turn's prompt) goes back to it. Keys chain-hash the prompt at multiples of `block` tokens (the model id seeds the
    chain); each finished request stores its longest such prefix; lookups take the longest remembered prefix of a
    new prompt. Bounded LRU: `capacity` entries, about one per conversation."""

    def __init__(self, capacity: int, block: int) -> None:
        self.capacity, self.block = capacity, block
        self._nodes: OrderedDict[bytes, str] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._nodes)

    def hashes(self, model_id: str, prompt: list[int]) -> list[bytes]:
        """hashes[i] identifies prompt[:(i + 1) * block]; only whole blocks count."""
        if not self.enabled:
            return []
        out, h = [], hashlib.blake2b(model_id.encode(), digest_size=16).digest()
        for start in range(0, len(prompt) - self.block + 1, self.block):
            block = array("I", prompt[start:start + self.block]).tobytes()  # token ids are < 2**32
            h = hashlib.blake2b(h + block, digest_size=16).digest()
            out.append(h)
        return out

    def lookup(self, hashes: list[bytes]) -> tuple[str, int] | None:
        """(node name, prefix tokens) for the longest remembered prefix, or None."""
        for i in range(len(hashes) - 1, -1, -1):
            node = self._nodes.get(hashes[i])
            if node is not None:
                self._nodes.move_to_end(hashes[i])
                return node, (i + 1) * self.block
        return None

    def remember(self, hashes: list[bytes], node: str) -> None:
        if not hashes or not self.enabled:
            return
        self._nodes[hashes[-1]] = node
        self._nodes.move_to_end(hashes[-1])
        while len(self._nodes) > self.capacity:
            self._nodes.popitem(last=False)


class Lease:
    """One admitted generation's hold on the cluster, taken by the orchestrator and released once by the generation:
    the model's in-flight count, the decode node's (None for the upstream), and on a finished release the prompt's
    prefix remembered for that node. `local_tokens`: prompt tokens the node prefills itself (local path)."""

    def __init__(self, admitted: dict[str, int], model_id: str, node: NodeState | None,
                 affinity: PrefixAffinity | None = None, prefix: list[bytes] | None = None,
                 local_tokens: int = 0, on_release: Callable[[], None] | None = None) -> None:
        self._admitted, self.model_id, self.node = admitted, model_id, node
        self._on_release = on_release  # the request queue's notify: capacity freed
        self._affinity, self._prefix = affinity, prefix or []
        self._held = True
        self.local_tokens = local_tokens if node is not None else 0
        admitted[model_id] = admitted.get(model_id, 0) + 1
        if node is not None:
            node.inflight += 1
            node.local_tokens += self.local_tokens

    def release(self, finished: bool) -> None:
        """Undo the counts (idempotent); `finished`: the generation completed, so its node now holds the prefix."""
        if not self._held:
            return
        self._held = False
        self._admitted[self.model_id] -= 1
        if self.node is not None:
            self.node.inflight -= 1
            self.node.local_tokens -= self.local_tokens
            if finished and self._affinity is not None:
                self._affinity.remember(self._prefix, self.node.name)
        if self._on_release is not None:
            self._on_release()
