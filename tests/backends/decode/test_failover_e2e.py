"""A client that goes away stops its generation on the real decode node (mlx-cpu), streaming or not: the node's
/health `running` count returns to 0 and its log says the client went away (a generation that ran to its end would
not say so). The seconds it took are printed, not asserted: this machine is shared and noisy.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from tests.support.stack import MODEL_ID

pytestmark = pytest.mark.e2e


def decode_health(stack) -> dict:
    req = urllib.request.Request(stack.url("decode-0") + "/health", headers=stack.node_headers)
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def running(stack) -> int:
    return int(decode_health(stack)["running"])


def wait_running(stack, want: int, timeout: float) -> float:
    """Seconds until the decode node's running count equals `want`."""
    t0 = time.monotonic()
    while running(stack) != want:
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"decode node still has {running(stack)} running after {timeout:.1f}s")
        time.sleep(0.05)
    return time.monotonic() - t0


def open_request(stack, stream: bool) -> socket.socket:
    """POST a long greedy generation over a raw socket, so the test decides exactly when the connection dies."""
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "Count from one to one thousand."}],
                       "max_tokens": 500, "temperature": 0, "stream": stream}).encode()
    port = int(stack.url("gateway").rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def hang_up(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST, not FIN
    sock.close()


def test_streaming_client_disconnect_stops_the_generation(stack):
    wait_running(stack, 0, 30)  # nothing left from an earlier test: the count below is this request's
    log_before = len(stack.log("decode-0"))
    sock = open_request(stack, stream=True)
    seen = b""
    while seen.count(b'"content"') < 5:  # the role chunk, then a few tokens
        chunk = sock.recv(65536)
        assert chunk, f"stream ended early: {seen[-500:]!r}"
        seen += chunk
    assert running(stack) == 1
    hang_up(sock)
    took = wait_running(stack, 0, 30)
    print(f"decode node stopped {took:.2f}s after the client hung up")
    assert "client went away" in stack.log("decode-0")[log_before:]


def test_non_streaming_client_disconnect_stops_the_generation(stack):
    wait_running(stack, 0, 30)  # nothing left from an earlier test: the count below is this request's
    log_before = len(stack.log("decode-0"))
    sock = open_request(stack, stream=False)
    wait_running(stack, 1, 60)
    for _ in range(600):  # the MLX thread publishes its cache after each decode step: hang up mid-generation
        if decode_health(stack)["cache_bytes"] > 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the decode node never started decoding")
    hang_up(sock)
    took = wait_running(stack, 0, 30)
    print(f"decode node stopped {took:.2f}s after the client hung up")
    assert "client went away" in stack.log("decode-0")[log_before:]
