"""Instant fake backends for bench_gateway.py, on a bare asyncio HTTP/1.1 server so the backend costs next to nothing.

One process, two ports: a decode node (docs/protocol.md: /health, NDJSON /v1/generate) and an OpenAI server
(/v1/chat/completions, JSON or SSE). Both answer at once with the same 8-token completion.
Run:  python -m bench._fakes --decode-port P --openai-port Q
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

MODEL_ID = "smollm2:135m"
# SmolLM2's tokenizer: "The capital of France is Paris. It" (real ids, so the gateway's pieces table works).
TOKENS = [(504, "The"), (3575, " capital"), (282, " of"), (4649, " France"), (314, " is"), (7042, " Paris"),
          (30, "."), (657, " It")]
TEXT = "".join(t for _, t in TOKENS)
PROMPT_TOKENS = 36  # what the OpenAI fake reports; the decode fake counts the ids it was sent


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _head(status: str, ctype: str, length: int | None = None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n{framing}\r\n\r\n".encode()


def _json(obj, status: str = "200 OK") -> bytes:
    body = _dumps(obj)
    return _head(status, "application/json", len(body)) + body


def _chunked(ctype: str, pieces: list[bytes]) -> bytes:
    # One HTTP chunk per line/event, as a real server flushes them; all written at once (the backend is instant).
    out = [_head("200 OK", ctype)]
    out += [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces]
    out.append(b"0\r\n\r\n")
    return b"".join(out)


HEALTH = _json({"status": "ok", "role": "decode", "models": [MODEL_ID], "fingerprint": {MODEL_ID: "00"}})
MODELS = _json({"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "fake"}]})
NOT_FOUND = _json({"error": {"message": "not found", "type": "invalid_request_error", "code": None}}, "404 Not Found")
TOKEN_LINES = [_dumps({"type": "token", "token_id": i, "text": t}) + b"\n" for i, t in TOKENS]
USAGE = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(TOKENS), "total_tokens": PROMPT_TOKENS + len(TOKENS)}


def generate(body: dict) -> bytes:
    """Decode node: accepted, one line per token, done (docs/protocol.md)."""
    n = len(body.get("token_ids") or ())
    done = {"type": "done", "finish_reason": "length", "prompt_tokens": n, "completion_tokens": len(TOKENS),
            "kv_tokens": 0, "computed_tokens": n, "fallback_reason": None, "kv_transfer_s": 0.0, "kv_bytes": 0,
            "ttft_s": 0.0}
    accepted = _dumps({"type": "accepted", "request_id": body.get("request_id")}) + b"\n"
    return _chunked("application/x-ndjson", [accepted, *TOKEN_LINES, _dumps(done) + b"\n"])


def chat(body: dict) -> bytes:
    """OpenAI /v1/chat/completions: a chat.completion, or chat.completion.chunk events ending in [DONE]."""
    base = {"id": "chatcmpl-fake", "created": int(time.time()), "model": body.get("model", MODEL_ID),
            "system_fingerprint": None}
    if not body.get("stream"):
        msg = {"role": "assistant", "content": TEXT}
        return _json({**base, "object": "chat.completion", "usage": USAGE,
                      "choices": [{"index": 0, "message": msg, "finish_reason": "length", "logprobs": None}]})
    chunk = {**base, "object": "chat.completion.chunk"}

    def ev(delta: dict, finish: str | None = None) -> bytes:
        c = {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return b"data: " + _dumps(c) + b"\n\n"

    events = [ev({"role": "assistant", "content": ""})] + [ev({"content": t}) for _, t in TOKENS] + [ev({}, "length")]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(b"data: " + _dumps({**chunk, "choices": [], "usage": USAGE}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return _chunked("text/event-stream", events)


def route(method: str, path: str, body: bytes) -> bytes:
    path = path.split("?", 1)[0]
    if method == "GET":
        return {"/health": HEALTH, "/v1/models": MODELS, "/models": MODELS}.get(path, NOT_FOUND)
    if path in ("/v1/chat/completions", "/chat/completions"):
        return chat(json.loads(body))
    if path == "/v1/generate":
        return generate(json.loads(body))
    if path.startswith("/v1/transfers/"):
        return _json({"aborted": False})
    return NOT_FOUND


class Http(asyncio.Protocol):
    """Keep-alive HTTP/1.1 with Content-Length request bodies: all the two proxies' clients send."""

    def connection_made(self, transport) -> None:
        self.t, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            n = int(hdrs.get("content-length", 0))
            if len(self.buf) < end + 4 + n:
                return
            body, self.buf = self.buf[end + 4:end + 4 + n], self.buf[end + 4 + n:]
            self.t.write(route(method, path, body))
            if hdrs.get("connection", "").lower() == "close":
                self.t.close()
                return


async def main(ports: list[int]) -> None:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(Http, "127.0.0.1", p, backlog=1024) for p in ports]
    print("fakes ready on", ports, flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode-port", type=int, required=True)
    ap.add_argument("--openai-port", type=int, required=True)
    a = ap.parse_args()
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(main([a.decode_port, a.openai_port]))
