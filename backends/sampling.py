"""Sampling parameters a decode node accepts, and stop-string matching over streamed text."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.common import bad_request


@dataclass(frozen=True)
class GenParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, body: dict) -> "GenParams":
        try:
            p = cls(max_tokens=int(body.get("max_tokens", 256)), temperature=float(body.get("temperature", 0.0)),
                    top_p=float(body.get("top_p", 1.0)),
                    seed=None if body.get("seed") is None else int(body["seed"]), stop=list(body.get("stop") or []))
        except (TypeError, ValueError) as e:
            raise bad_request(f"bad sampling parameter: {e}") from None
        if p.max_tokens < 1 or p.temperature < 0 or not 0 < p.top_p <= 1:
            raise bad_request("need max_tokens >= 1, temperature >= 0 and 0 < top_p <= 1")
        if not all(isinstance(s, str) and s for s in p.stop):
            raise bad_request("stop must be a list of non-empty strings")
        return p


class StopMatcher:
    """Holds back just enough streamed text to never emit the start of a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was hit); after a hit the rest is dropped."""
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        cut = max(len(self.buf) - self.hold, 0)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
