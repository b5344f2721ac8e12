"""What one request's way through the pool has met so far (`Attempt`), and what every generation the orchestrator
hands out provides (`GenerationStream`: a decode node's `Generation`, `Resumable` over it, `UpstreamGeneration`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from kv_bridge.config.models import ModelRoute
from kv_bridge.protocol import DoneLine, Path, TokenLine


@dataclass
class Attempt:
    """One request's attempt to open a generation: `tried` the decode nodes that failed or refused (skipped from
    then on), `busy` those of them that answered 429, `fallbacks` the reasons in the order they happened."""

    tried: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)

    def failed(self, node: str, reason: str, busy: bool = False) -> None:
        self.tried.append(node)
        self.fallbacks.append(reason)
        if busy:
            self.busy.append(node)


class Named(Protocol):
    @property
    def name(self) -> str: ...


class GenerationStream(Protocol):
    """Iterate `tokens()`; then `done` is set and `path` is the path taken. Always `close()`."""

    route: ModelRoute
    prompt: list[int]
    done: DoneLine | None

    @property
    def decode(self) -> Named: ...

    @property
    def request_id(self) -> str: ...

    @property
    def fallbacks(self) -> list[str]: ...

    @property
    def planned_path(self) -> Path: ...

    @property
    def path(self) -> Path: ...

    @property
    def prefill_s(self) -> float | None: ...

    def headers(self) -> dict[str, str]: ...

    def tokens(self) -> AsyncIterator[TokenLine]: ...

    async def close(self) -> None: ...
