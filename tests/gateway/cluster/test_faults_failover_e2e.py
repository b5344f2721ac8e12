"""Faults on the real stack with two decode nodes, decode-0's KV arriving through a TCP relay in this process:

- kill -9 of the decode node serving a long greedy stream: the same client stream goes on on the other node, and
  the client's text equals the uninterrupted run; the killed node, restarted, serves again;
- a KV connection cut mid-frame by the relay: the request completes through decode-local prefill, counted;
- kill -9 of the prefill node mid-transfer (the relay throttles the link so the transfer is long): decode-local
  prefill, greedy text equal to MLX alone. (A killed prefill node restarted and taking the split again is
  test_burst_e2e's subject, on the session stack, and test_up's; a second vLLM start here proved nothing more.)
Each checks that nothing is left behind: the decode nodes' /health shows no running generation and no transfer.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.support.stack import MODEL_ID, Stack, in_thread

pytestmark = pytest.mark.e2e
FALLBACK_REASONS = ("kv_aborted", "kv_error", "kv_timeout")
# ~65 tokens (~100 with the chat template), 4.5 MB of float32 KV: long enough to cut at 300 KB or throttle past
# 500 KB mid-transfer, and short: each fallback prefills it on MLX, and so does its reference.
LONG_PROMPT = ("Here are notes on the history of the printing press, paper making, ink, type founding, and the "
               "spread of books across Europe in the fifteenth and sixteenth centuries. ") * 2


class Relay:
    """TCP relay in front of a decode node's kv_port. Prefill -> decode goes at most `rate` bytes/s (None: at full
    speed); with `cut_after`, both sides are closed once that many bytes of a connection went through."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.target_port = 0
        self.rate: float | None = None
        self.cut_after: int | None = None
        self.forwarded = 0  # bytes of the latest connection
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        up = socket.create_connection(("127.0.0.1", self.target_port))
        threading.Thread(target=self._pipe_back, args=(up, conn), daemon=True).start()
        self.forwarded = 0
        try:
            while True:
                room = 65536 if self.cut_after is None else min(65536, self.cut_after - self.forwarded)
                data = conn.recv(room) if room > 0 else b""
                if not data:
                    break
                up.sendall(data)
                self.forwarded += len(data)
                if self.rate:
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            for s in (up, conn):
                with _quiet():
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    @staticmethod
    def _pipe_back(up: socket.socket, conn: socket.socket) -> None:
        with _quiet():
            while data := up.recv(65536):
                conn.sendall(data)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


@pytest.fixture(scope="module")
def relay():
    r = Relay()
    yield r
    r.close()


@pytest.fixture(scope="module")
def stack2(tmp_path_factory, relay):
    # The KV canary off: this stack's subject is failover, and its relay is cut and restored under the canary's feet.
    s = Stack(tmp_path_factory.mktemp("stack2"), decode_nodes=2, kv_advertise_port={"decode-0": relay.port},
              fidelity=False)
    relay.target_port = s.settings.node("decode-0").kv_port
    with s.running(["decode-0", "decode-1", "prefill-0", "gateway"]):
        yield s


def request(stack: Stack, content: str, max_tokens: int, stream: bool = False):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    req = urllib.request.Request(stack.url("gateway") + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    # The gateway's request_timeout_s bounds every generation; a client waiting longer means something hung.
    return urllib.request.urlopen(req, timeout=stack.settings.gateway.request_timeout_s)


def complete(stack: Stack, content: str, max_tokens: int) -> tuple[dict, dict]:
    with request(stack, content, max_tokens) as r:
        return dict(r.headers), json.loads(r.read())


def node_health(stack: Stack, name: str) -> dict:
    with urllib.request.urlopen(stack.url(name) + "/health", timeout=5) as r:
        return json.loads(r.read())


def assert_nothing_left(stack: Stack) -> None:
    for name in ("decode-0", "decode-1"):
        h = node_health(stack, name)
        assert (h["running"], h["transfers"]) == (0, 0), (name, h)


def fallbacks(stack: Stack, reason: str) -> float:
    with urllib.request.urlopen(stack.url("gateway") + "/metrics", timeout=5) as r:
        text = r.read().decode()
    want = f'disagg_fallbacks_total{{model="{MODEL_ID}",reason="{reason}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))


def mlx_alone(mlx_ref, hf_tokenizer, content: str, max_tokens: int) -> str:
    from mlx_lm import generate

    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    model, tok = mlx_ref
    return generate(model, tok, prompt=hf_tokenizer.encode(text, add_special_tokens=False), max_tokens=max_tokens)


def test_decode_node_killed_mid_stream_fails_over_and_comes_back(stack2):
    content, max_tokens = "Tell me a long story about a fox who lived in a forest.", 40  # ~30 after the kill
    _, ref = complete(stack2, content, max_tokens)  # both nodes alive: the uninterrupted run
    before = fallbacks(stack2, "decode_failover")
    text, finish, killed = "", [], None
    with request(stack2, content, max_tokens, stream=True) as r:
        serving = r.headers["x-disagg-decode-node"]
        chunks = 0
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[len("data: "):])
            assert "error" not in ev, ev
            text += ev["choices"][0]["delta"].get("content") or ""
            finish += [ev["choices"][0]["finish_reason"]] if ev["choices"][0]["finish_reason"] else []
            chunks += 1
            if chunks == 10:  # well into the stream: kill -9 the node under it
                stack2.kill(serving)
                killed = serving
                stack2.spawn(killed)  # its restart starts while the stream goes on on the other node
    assert killed is not None
    assert text == ref["choices"][0]["message"]["content"]
    assert finish == [ref["choices"][0]["finish_reason"]]
    assert fallbacks(stack2, "decode_failover") == before + 1
    survivor = "decode-1" if killed == "decode-0" else "decode-0"
    assert node_health(stack2, survivor)["running"] == 0
    stack2.wait_up(killed)
    stack2.wait_gateway_sees(killed)
    assert_nothing_left(stack2)
    # Idle nodes tie and the earlier in the route wins, so decode-0 takes a fresh conversation; to land on decode-1
    # keep decode-0 busy with a stream meanwhile.
    busy = request(stack2, "Count from one to fifty.", 60, stream=True) if killed == "decode-1" else None
    try:
        headers, body = complete(stack2, "Say hello.", 8)
    finally:
        if busy is not None:
            busy.close()
    assert headers["x-disagg-decode-node"] == killed
    assert body["choices"][0]["message"]["content"]


def test_kv_connection_cut_mid_frame_falls_back_to_local_prefill(stack2, relay, mlx_ref, hf_tokenizer):
    content = "Cut: " + LONG_PROMPT
    ref = in_thread(mlx_alone, mlx_ref, hf_tokenizer, content, 8)  # beside the decode node's own local prefill
    relay.rate, relay.cut_after = None, 300_001  # well inside the first layers' frames, not at a boundary
    befores = {r: fallbacks(stack2, r) for r in FALLBACK_REASONS}
    try:
        headers, body = complete(stack2, content, 8)
    finally:
        relay.cut_after = None
    assert relay.forwarded == 300_001
    assert headers["x-disagg-decode-node"] == "decode-0" and headers["x-disagg-path"] == "fallback", headers
    reason = headers["x-disagg-fallbacks"].split(",")[-1]
    assert reason in FALLBACK_REASONS
    assert fallbacks(stack2, reason) == befores[reason] + 1
    assert body["choices"][0]["message"]["content"] == ref.result()
    assert_nothing_left(stack2)
    headers, _ = complete(stack2, "Again: " + LONG_PROMPT, 4)  # the link is whole again: disaggregated
    assert headers["x-disagg-path"] == "disaggregated", headers


def test_prefill_node_killed_mid_transfer_falls_back_to_local_prefill(stack2, relay, mlx_ref, hf_tokenizer):
    content = "Kill: " + LONG_PROMPT
    ref = in_thread(mlx_alone, mlx_ref, hf_tokenizer, content, 8)  # beside the decode node's own local prefill
    relay.rate = 1_000_000  # ~46 KB of float32 KV per token here: a transfer of ~4 s, killed ~0.5 s in
    result: dict = {}

    def call() -> None:
        try:
            result["headers"], result["body"] = complete(stack2, content, 8)
        except Exception as e:  # noqa: BLE001 (re-raised in the test thread)
            result["error"] = e

    t = threading.Thread(target=call)
    relay.forwarded = 0
    t.start()
    try:
        while relay.forwarded < 500_000:
            assert t.is_alive(), result
            time.sleep(0.05)
        stack2.kill("prefill-0")
    finally:
        relay.rate = None
        t.join(stack2.settings.gateway.request_timeout_s)
    assert not t.is_alive() and "error" not in result, result
    headers, body = result["headers"], result["body"]
    assert headers["x-disagg-decode-node"] == "decode-0" and headers["x-disagg-path"] == "fallback", headers
    assert headers["x-disagg-fallbacks"].split(",")[-1] in FALLBACK_REASONS
    assert body["choices"][0]["message"]["content"] == ref.result()
    assert_nothing_left(stack2)
