"""An HTTP proxy in front of a real node that records the JSON bodies it forwards, so an end-to-end test can read
the exact request (token ids) the gateway sent. Responses are relayed whole (an NDJSON stream arrives at its end)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class RecordingProxy:
    """`RecordingProxy(target_url)`; `.port` to point the gateway at; `.bodies(path)` the JSON posted to `path`."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.posted: list[tuple[str, dict]] = []
        self.headers: list[dict] = []  # each posted body's request headers, in the same order
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                proxy._forward(self, None)

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy._forward(self, raw)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def bodies(self, path: str) -> list[dict]:
        return [b for p, b in self.posted if p == path]

    def _forward(self, h: BaseHTTPRequestHandler, raw: bytes | None) -> None:
        if raw is not None:
            try:
                self.posted.append((h.path, json.loads(raw)))
                self.headers.append(dict(h.headers.items()))
            except ValueError:
                pass
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        req = urllib.request.Request(self.target + h.path, data=raw, headers=headers, method=h.command)
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                status, out, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, out, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
        except OSError as e:  # the node is down: the gateway sees a failing node, as without the proxy
            status, out, ctype = 502, str(e).encode(), "text/plain"
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(out)))
        h.end_headers()
        h.wfile.write(out)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
