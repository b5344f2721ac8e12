"""Stop-string matching over streamed text, shared by the decode node (which ends a generation at a stop string) and
the gateway (which goes on matching after a mid-stream failover, so a stop string spanning the break is caught)."""

from __future__ import annotations


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
