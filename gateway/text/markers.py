"""Incremental splitting of streamed model text on marker strings (special tokens as text: `<|channel|>`, `<think>`).

Works on any chunking: decode-node tokens, mid-stream failover's joined streams, an upstream's text deltas.
"""

from __future__ import annotations

from collections.abc import Iterable


class MarkerScanner:
    """Feed text chunks; get ("text", s) and ("marker", m) pieces in order. A chunk's tail that could be the start
    of a marker is held back until the next chunk (or `flush`) decides it."""

    def __init__(self, markers: Iterable[str]):
        self.markers = sorted(set(markers), key=len, reverse=True)
        self._prefixes = {m[:i] for m in self.markers for i in range(1, len(m))}
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf:
            at, marker = self._first_marker()
            if marker is None:
                keep = self._held_tail()
                if len(self._buf) > keep:
                    out.append(("text", self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                break
            if at:
                out.append(("text", self._buf[:at]))
            out.append(("marker", marker))
            self._buf = self._buf[at + len(marker):]
        return out

    def flush(self) -> list[tuple[str, str]]:
        rest, self._buf = self._buf, ""
        return [("text", rest)] if rest else []

    def _first_marker(self) -> tuple[int, str | None]:
        best, found = len(self._buf), None
        for m in self.markers:  # longest first: on a tie the longer marker wins
            i = self._buf.find(m)
            if i != -1 and i < best:
                best, found = i, m
        return best, found

    def _held_tail(self) -> int:
        """Length of the longest suffix of the buffer that is a proper prefix of a marker."""
        for n in range(min(len(self._buf), max((len(m) for m in self.markers), default=1) - 1), 0, -1):
            if self._buf[-n:] in self._prefixes:
                return n
        return 0
