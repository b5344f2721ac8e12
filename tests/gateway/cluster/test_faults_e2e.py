"""Faults on the real stack: kill -9 of the decode node mid-stream ends the client's stream with an error event
and [DONE] (no hang), `disagg status` shows the node DOWN, and the node serves again once restarted (the session
stack's one decode restart)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.support.stack import MODEL_ID

pytestmark = pytest.mark.e2e


def stream_request(stack, max_tokens: int):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Tell me a long story about a fox."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    req = urllib.request.Request(stack.url("gateway") + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120)


def test_decode_node_killed_mid_stream_then_restarted(stack):
    # A hung stream fails the read below with a timeout (urlopen's, per read), not this test's own clock.
    with stream_request(stack, 400) as r:
        lines = []
        for raw in r:
            line = raw.decode().strip()
            if not line:
                continue
            lines.append(line)
            if len(lines) == 3:  # a few tokens in: kill -9 the decode node under the stream
                stack.kill("decode-0")
    assert len(lines) < 400, "the stream ran on after the kill"
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert "error" in events[-1], events[-1]
    r = subprocess.run([sys.executable, "-m", "backends.cli.main", "status", "--config", str(stack.config), "--probe-mib",
                        "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and any(line.startswith("!!") and "decode-0" in line and "DOWN" in line
                                     for line in r.stdout.splitlines()), r.stdout + r.stderr
    stack.start("decode-0")
    lines = []
    for _ in range(60):  # 503 until the gateway's health checks see the restarted node
        try:
            with stream_request(stack, 8) as r:
                lines = [raw.decode().strip() for raw in r if raw.strip()]
        except urllib.error.HTTPError as e:
            assert e.code == 503
            time.sleep(0.5)
            continue
        if not any('"error"' in ln for ln in lines):
            break
        time.sleep(0.5)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines)
