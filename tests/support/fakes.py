"""Fake prefill and decode nodes that speak docs/protocol.md over real HTTP, plus a gateway harness, for tests.

FakeDecodeNode answers with a fixed reply, tokenized and detokenized with the real SmolLM2 tokenizer.
FakePrefillNode "sends" KV by telling the decode fake whose kv_port the gateway named in kv_target.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import uuid
from functools import lru_cache
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from tests.support import oracle
from kv_bridge.config.settings import Settings
from kv_bridge.stops import StopMatcher

MODEL_ID = "smollm2:135m"
MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"
REPLY = "The capital of France is Paris."


@lru_cache(maxsize=1)
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample `name` with `labels` in a Prometheus exposition, or None."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


class HeldKV:
    """Received KV as MLXModel.prompt_cache takes it (keys, values, release()), for KV a test or bench holds itself
    and may hand over more than once: release() gives nothing back."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def release(self):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                             status=status)


class FakeNode:
    role = ""

    def __init__(self, name: str, model_id: str = MODEL_ID) -> None:
        self.name, self.model_id = name, model_id
        self.down = False  # /health (and work) answer 503 "loading"
        # What /health says of who answers (backends/common.py): a new boot_id is a restarted process, a new kv_digest
        # a changed KV configuration; None leaves the field out (a node from before they existed).
        self.boot_id: str | None = uuid.uuid4().hex
        self.kv_digest: str | None = "kv0"
        self.kv_dtype = "float32"  # shown beside the digest (a real node lists every field it hashes)
        self.weights: dict | None = None  # its kv_identity's weight_precision ({"scheme", "bits"}); None: left out
        self.port = 0
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self) -> "FakeNode":
        app = web.Application()
        app.router.add_get("/health", self._health)
        self.routes(app)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port or 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        if self.down:
            return web.json_response({"status": "loading", "role": self.role}, status=503)
        body = {"status": "ok", "role": self.role, "models": [self.model_id], "fingerprint": {self.model_id: "00"}}
        if self.boot_id is not None:
            body["boot_id"] = self.boot_id
        if self.kv_digest is not None:
            ident = {"digest": self.kv_digest, "dtype": self.kv_dtype}
            body["kv_identity"] = {self.model_id: ident if self.weights is None else {**ident, "weights": self.weights}}
        return web.json_response(body)


@dataclass
class _Transfer:
    expected: int
    event: asyncio.Event = field(default_factory=asyncio.Event)
    delivered: int | None = None
    aborted: bool = False


class FakeDecodeNode(FakeNode):
    """Modes: None, "kv_error" (report fallback), "kv_fidelity" (the KV arrived and failed the real-traffic check), "fail_mid_stream" (error line), "drop_mid_stream" (cut TCP),
    "http_500" (answer 500 before any stream starts), "kv_capacity" (answer 429 to requests that want KV and to the
    fidelity canary, as a real decode node over its kv.max_inflight_bytes does). A mid-stream failure comes after `break_after` tokens.

    With `continues`, like a greedy model whose answer to everything is the reply: a prompt that already ends with
    the reply's first j tokens (a continuation after a failover) gets the rest of it. Stop strings are matched as the
    real node does."""

    role = "decode"

    def __init__(self, name: str, model_id: str = MODEL_ID, reply: str = REPLY, kv_timeout_s: float = 2.0) -> None:
        super().__init__(name, model_id)
        self.tok = _tokenizer()
        self.reply_ids = self.tok.encode(reply, add_special_tokens=False).ids
        self.kv_port = free_port()
        self.kv_timeout_s = kv_timeout_s
        self.mode: str | None = None
        self.token_delay = 0.0
        self.hold: asyncio.Event | None = None  # set: the next generation (only) waits for it before its first token
        self.break_after = 2
        self.continues = False
        self.skip_special = True  # decoded text leaves special tokens out (SmolLM2's reply has none)
        self.script = None  # prompt text -> reply: an answer that depends on the turn (speak's tokenizer)
        self.held_prefix = 0  # leading prompt tokens whose KV this node claims to hold (its kv_start, capped)
        self.requests: list[dict] = []
        self.aborts: list[str] = []
        self.disconnects: list[str] = []
        self.running = 0
        self._transfers: dict[str, _Transfer] = {}
        # The KV fidelity canary (backends/decode/canary.py's routes): the worst relative error this node "measures" on the
        # KV a prefill node delivers; past the float32 tolerance (0.01) the verdict is failed.
        self.fidelity_error = 1e-5
        self.excess = 0.1  # the rel. RMS allowance past the wire's own it reports needing (calibration)
        self.gains = [[0.97, 0.95], [0.9, 0.93]]  # per layer, each KV head's gain it reports (K and V alike)
        self.long_canary = True  # it runs the long (start_canary_tokens) form when asked ("long": true)
        self.canaries = 0
        self.canary_hold: asyncio.Event | None = None  # set: every canary's comparison waits for it
        self.canary_bodies: list[dict] = []  # what each /v1/fidelity/expect asked (the pair's weights, an allowance)
        self._asked: dict[str, dict] = {}  # canary transfer id -> its expect body

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/generate", self._generate)
        app.router.add_post("/v1/transfers/{rid}/abort", self._abort)
        app.router.add_post("/v1/fidelity/expect", self._canary_expect)
        app.router.add_get("/v1/fidelity/{tid}", self._canary_result)

    async def _canary_expect(self, request: web.Request) -> web.Response:
        if self.down:
            return _error(503, "loading")
        if self.mode == "kv_capacity":  # a busy node: its KV budget is taken by requests
            resp = _error(429, "over kv.max_inflight_bytes (fake)")
            resp.headers["Retry-After"] = "1"
            return resp
        self.canary_bodies.append(await request.json())
        tid = f"canary-{uuid.uuid4().hex}"
        ids = self.tok.encode("The river town of Alder Bend kept its records in a stone hall.").ids
        self._transfers[tid] = _Transfer(len(ids) - 1)
        self._asked[tid] = self.canary_bodies[-1]
        return web.json_response({"transfer_id": tid, "token_ids": ids[:-1],
                                  "kv_target": {"host": "127.0.0.1", "port": self.kv_port}})

    async def _canary_result(self, request: web.Request) -> web.Response:
        tid = request.match_info["tid"]
        kv_tokens, fallback = await self._await_kv(tid)
        self._transfers.pop(tid, None)
        if self.canary_hold is not None:
            await self.canary_hold.wait()
        self.canaries += 1
        asked = self._asked.pop(tid, {})
        long = self.long_canary and asked.get("long") is True
        base = {"model": self.model_id, "prefill": "", "decode": self.name, "tokens": kv_tokens, "long": long}
        if fallback is not None:
            return web.json_response({**base, "state": "error", "message": f"KV did not arrive: {fallback}"})
        bad = self.fidelity_error > 0.01
        layers = [{"layer": i, "k_gains": g, "v_gains": g} for i, g in enumerate(self.gains)]
        return web.json_response({**base, "state": "failed" if bad else "verified", "error": self.fidelity_error,
                                  "layer": 3, "tensor": "K", "tolerance": 0.01, "wire_dtype": "float32",
                                  "kv_dtype": "float32", "greedy": "0/8" if bad else "8/8", "kl": 2.0 if bad else 1e-6,
                                  "seconds": 0.01, "excess": self.excess, "gain_band": "gain_band" in asked,
                                  "layers": layers})

    def deliver_kv(self, request_id: str, tokens: int) -> bool:
        t = self._transfers.get(request_id)
        if t is None:
            return False
        t.delivered = tokens
        t.event.set()
        return True

    def speak(self, folder: Path, reply: str) -> None:
        """Answer `reply` as token ids of the tokenizer in `folder` (a family tokenizer: harmony, <think>), its
        special tokens streamed as text as mlx-lm's detokenizer streams them."""
        self.tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        self.reply_ids = self.tok.encode(reply, add_special_tokens=False).ids
        self.skip_special = False

    def reply_text(self, max_tokens: int) -> str:
        return self.tok.decode(self.reply_ids[:max_tokens])

    async def _abort(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        self.aborts.append(rid)
        t = self._transfers.get(rid)
        if t is not None and not t.event.is_set():
            t.aborted = True
            t.event.set()
            return web.json_response({"aborted": True})
        return web.json_response({"aborted": False})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        hold, self.hold = self.hold, None
        if self.down:
            return _error(503, "loading")
        if self.mode == "http_500":
            return _error(500, "fake decode failure before the stream")
        if body.get("model") != self.model_id:
            return _error(400, f"unknown model {body.get('model')!r}")
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return _error(400, "token_ids must be a non-empty list of ints")
        rid = body["request_id"]
        if self.script is not None:
            reply = self.script(self.tok.decode(ids, skip_special_tokens=False))
            self.reply_ids = self.tok.encode(reply, add_special_tokens=False).ids
        if self.mode == "kv_capacity" and body.get("kv") is not None:
            resp = _error(429, "over kv.max_inflight_bytes (fake)")
            resp.headers["Retry-After"] = "1"
            return resp
        accepted, start = {"type": "accepted", "request_id": rid}, 0
        if body.get("kv") is not None:
            start = accepted["kv_start"] = min(self.held_prefix, int(body["kv"]["tokens"]))
            if start < int(body["kv"]["tokens"]):
                self._transfers[rid] = _Transfer(expected=int(body["kv"]["tokens"]) - start)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        self.running += 1
        try:
            await self._write(resp, accepted)
            kv_tokens, fallback = await self._await_kv(rid)
            if hold is not None:
                await hold.wait()
            await self._tokens(request, resp, body, kv_tokens, fallback, start)
        except ConnectionResetError:
            self.disconnects.append(rid)
        finally:
            self.running -= 1
            self._transfers.pop(rid, None)
        return resp

    async def _await_kv(self, rid: str) -> tuple[int, str | None]:
        t = self._transfers.get(rid)
        if t is None:
            return 0, None
        try:
            await asyncio.wait_for(t.event.wait(), self.kv_timeout_s)
        except asyncio.TimeoutError:
            return 0, "kv_timeout"
        if t.aborted:
            return 0, "kv_aborted"
        if self.mode == "kv_error" or t.delivered != t.expected:
            return 0, "kv_error"
        if self.mode == "kv_fidelity":  # arrived, but its layer 0 failed the real-traffic check
            return 0, "kv_fidelity"
        return t.expected, None

    def _continued(self, prompt: list[int]) -> int:
        """How many of the reply's first tokens the prompt already ends with (with `continues`; else 0)."""
        if not self.continues:
            return 0
        return max((j for j in range(len(self.reply_ids) + 1) if prompt[len(prompt) - j:] == self.reply_ids[:j]),
                   default=0)

    async def _tokens(self, request, resp, body: dict, kv_tokens: int, fallback: str | None, prefix: int = 0) -> None:
        max_tokens = int(body.get("max_tokens") or 16)
        rest = self.reply_ids[self._continued(body["token_ids"]):]
        out = rest[:max_tokens]
        stops, finish = StopMatcher(list(body.get("stop") or [])), "length" if len(rest) > max_tokens else "stop"
        for i, tid in enumerate(out):
            if i == self.break_after and self.mode == "fail_mid_stream":
                await self._write(resp, {"type": "error", "message": "fake decode failure"})
                return
            if i == self.break_after and self.mode == "drop_mid_stream":
                request.transport.close()
                return
            # Per-token text is the growth of the decoded prefix, as a real detokenizer streams it.
            dec = lambda ids: self.tok.decode(ids, skip_special_tokens=self.skip_special)  # noqa: E731
            text, hit = stops.feed(dec(out[: i + 1])[len(dec(out[:i])):])
            if i == len(out) - 1 and not hit:
                text += stops.flush()
            await self._write(resp, {"type": "token", "token_id": tid, "text": text, **fake_logprobs(body, i, tid)})
            if hit:
                out, finish = out[: i + 1], "stop"
                break
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
        if self.mode in ("fail_mid_stream", "drop_mid_stream") and self.break_after == len(out):
            request.transport.close()  # after the last token, before the done line
            return
        n = len(body["token_ids"])
        await self._write(resp, {
            "type": "done", "finish_reason": finish,
            "prompt_tokens": n, "completion_tokens": len(out), "kv_tokens": kv_tokens, "prefix_tokens": prefix,
            "computed_tokens": n - kv_tokens - prefix, "fallback_reason": fallback,
            "kv_transfer_s": 0.02 if kv_tokens else 0.0, "kv_link_s": 0.005 if kv_tokens else 0.0,
            "kv_bytes": kv_tokens * 1000, "ttft_s": 0.01,
            **({"kv_check": "K layer 0 position 40 error 1.4 (tolerance 0.1)"} if fallback == "kv_fidelity" else {}),
        })

    @staticmethod
    async def _write(resp: web.StreamResponse, obj: dict) -> None:
        await resp.write((json.dumps(obj) + "\n").encode())


def fake_logprobs(body: dict, i: int, tid: int) -> dict:
    """Deterministic logprob fields when the request asked for them: the chosen token first, then tid+1, tid+2..."""
    k = body.get("logprobs")
    if k is None:
        return {}
    chosen = -0.125 * (i + 1)
    return {"logprob": chosen, "top_logprobs": [[tid + j, chosen - j] for j in range(k)]}


class FakePrefillNode(FakeNode):
    """fail: None, "http" (answer 500), "kv" (502 kv_not_delivered, as a node whose KV stream never opened answers,
    having sent nothing), or "hang" (never answer). `seconds_per_token`: each call computes for that long
    per prompt token, one call at a time like a saturated engine (`running`/`max_running`: calls inside it)."""

    role = "prefill"

    def __init__(self, name: str, decoders: list[FakeDecodeNode], model_id: str = MODEL_ID) -> None:
        super().__init__(name, model_id)
        self.decoders = decoders
        self.fail: str | None = None
        self.requests: list[dict] = []
        self.seconds_per_token = 0.0
        self.hold: asyncio.Event | None = None  # set: the next call (only) computes until it is set
        self.running = self.max_running = 0
        self._engine = asyncio.Lock()

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/prefill", self._prefill)

    async def _compute(self, tokens: int) -> None:
        hold, self.hold = self.hold, None
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            async with self._engine:
                if hold is not None:
                    await hold.wait()
                await asyncio.sleep(tokens * self.seconds_per_token)
        finally:
            self.running -= 1

    async def _prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        canary = body["request_id"].startswith("canary-")  # the gateway's fidelity check, not a client's request
        if not canary:
            self.requests.append(body)
        if self.down:
            return _error(503, "loading")
        if self.fail == "http":
            return _error(500, "fake prefill failure")
        if self.fail == "kv":
            return _error(502, f"the KV of {body['request_id']} did not reach its decode node: cannot open KV stream",
                          "kv_not_delivered")
        if self.fail == "hang":
            await asyncio.sleep(3600)
        if not canary:
            await self._compute(len(body["token_ids"]) - int(body.get("kv_start", 0)))
        target = body["kv_target"]
        for d in self.decoders:
            if (target["host"], target["port"]) == ("127.0.0.1", d.kv_port):
                d.deliver_kv(body["request_id"], len(body["token_ids"]) - int(body.get("kv_start", 0)))
        return web.json_response({"request_id": body["request_id"], "num_tokens": len(body["token_ids"]),
                                  "prefill_s": 0.001})


def make_settings(decoders: list[FakeDecodeNode], prefills: list[FakePrefillNode], *, interval: float = 0.2,
                  max_model_len: int = 4096, min_disagg_tokens: int = 32, model_dir: Path = MODEL_DIR,
                  route: dict | None = None, gateway: dict | None = None,
                  nodes_extra: dict[str, dict] | None = None, fidelity: dict | None = None) -> Settings:
    """Settings with every section explicit, so no config.toml or DISAGG_* value leaks in. `route`, `gateway` and
    `nodes_extra` (node name -> fields) add fields to the model route, [gateway] and [[nodes]]."""
    extra = nodes_extra or {}
    nodes = [{"name": d.name, "role": "decode", "host": "127.0.0.1", "port": d.port, "kv_port": d.kv_port,
              **extra.get(d.name, {})} for d in decoders]
    nodes += [{"name": p.name, "role": "prefill", "host": "127.0.0.1", "port": p.port, **extra.get(p.name, {})}
              for p in prefills]
    return Settings(
        gateway={"host": "127.0.0.1", "port": free_port(), "request_timeout_s": 30.0, "health_interval_s": interval,
                 **(gateway or {})},
        # an operator's re-check is not rate-limited here unless a test says so (tests post /fidelity back to back)
        prefill={}, decode={}, kv={}, fidelity={"recheck_min_s": 0, **(fidelity or {})}, nodes=nodes,
        models=[{"id": MODEL_ID, "path": str(model_dir), "prefill": [p.name for p in prefills],
                 "decode": [d.name for d in decoders], "max_model_len": max_model_len,
                 "min_disagg_tokens": min_disagg_tokens, **(route or {})}],
    )


UPSTREAM_REPLY = "Upstream says: the capital of France is Paris."


class FakeUpstream:
    """An OpenAI-compatible server (POST /v1/chat/completions and /v1/completions, whole or SSE) standing in for
    the upstream the gateway calls through litellm. fail: None or "http" (answer 500). Records bodies and headers."""

    def __init__(self, reply: str = UPSTREAM_REPLY) -> None:
        self.reply = reply
        self.fail: str | None = None
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> "FakeUpstream":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port or 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _pieces(self, body: dict) -> tuple[list[str], str]:
        words = self.reply.split(" ")
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
        limit = body.get("max_tokens")
        if isinstance(limit, int) and limit < len(pieces):
            return pieces[:limit], "length"
        return pieces, "stop"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.fail == "http":
            return web.json_response({"error": {"message": "fake upstream failure", "type": "server_error",
                                                "code": None}}, status=500)
        pieces, finish = self._pieces(body)
        use = {"prompt_tokens": 11, "completion_tokens": len(pieces), "total_tokens": 11 + len(pieces)}
        head = {"id": "up-1", "created": 1, "model": body.get("model")}
        if not body.get("stream"):
            text = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                      if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
            return web.json_response({**head, "object": "chat.completion" if chat else "text_completion",
                                      "choices": [choice], "usage": use})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def choice(text: str | None, reason: str | None) -> dict:
            if chat:
                return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": reason}
            return {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}

        events = [{**head, "object": obj, "choices": [choice(p, None)]} for p in pieces]
        events.append({**head, "object": obj, "choices": [choice(None, finish)]})
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**head, "object": obj, "choices": [], "usage": use})
        for ev in events:
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


class Cluster:
    """Fake nodes plus a real gateway app on ephemeral ports; `http` is a client session for the tests."""

    def __init__(self, n_decode: int = 1, n_prefill: int = 1, upstream: bool = False, **settings_kw) -> None:
        self.decoders = [FakeDecodeNode(f"decode-{i}") for i in range(n_decode)]
        self.prefills = [FakePrefillNode(f"prefill-{i}", self.decoders) for i in range(n_prefill)]
        self.upstream = FakeUpstream() if upstream else None
        self.settings_kw = settings_kw
        self.settings: Settings | None = None
        self.url = ""
        self.http: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    @property
    def decode(self) -> FakeDecodeNode:
        return self.decoders[0]

    @property
    def prefill(self) -> FakePrefillNode:
        return self.prefills[0]

    async def start(self) -> "Cluster":
        from gateway.app import create_app

        for node in [*self.decoders, *self.prefills]:
            await node.start()
        if self.upstream is not None:
            await self.upstream.start()
            route = dict(self.settings_kw.pop("route", None) or {})
            route["upstream"] = {"model": "openai/gpt-fake", "api_base": self.upstream.url, **route.get("upstream", {})}
            self.settings_kw["route"] = route
        self.settings = make_settings(self.decoders, self.prefills, **self.settings_kw)
        self._runner = web.AppRunner(create_app(self.settings), shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self.http = aiohttp.ClientSession()
        await self.wait_fidelity()
        return self

    async def wait_fidelity(self, timeout: float = 5.0) -> list[dict]:
        """Until the gateway's canary has a verdict for every pair whose fake nodes are up (as a real stack waits
        before it serves disaggregated); the pairs as /health shows them."""
        fakes = {n.name: n for n in [*self.decoders, *self.prefills]}

        from gateway.api.serving import STATE

        checks = self._runner.app[STATE].fidelity  # in process: /health may need a key

        async def settled() -> bool:
            return all(row["state"] not in ("pending", "checking") and not (row["state"] == "provisional"
                                                                              and not row["last_error"])
                       or fakes[row["prefill"]].down or fakes[row["decode"]].down for row in checks.snapshot())
        await self.wait_for(settled, timeout)
        return checks.snapshot()

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self._runner is not None:
            await self._runner.cleanup()
        for node in [*self.decoders, *self.prefills]:
            await node.stop()
        if self.upstream is not None:
            await self.upstream.stop()

    async def chat(self, body: dict | None = None, raw: bytes | None = None) -> tuple[int, dict, dict]:
        """POST /v1/chat/completions; returns (status, headers, json)."""
        return await self.post("/v1/chat/completions", body, raw)

    async def post(self, path: str, body: dict | None = None, raw: bytes | None = None) -> tuple[int, dict, dict]:
        """POST a JSON body (or raw bytes) to the gateway; returns (status, headers, json)."""
        kw = {"data": raw, "headers": {"Content-Type": "application/json"}} if raw is not None else {"json": body}
        async with self.http.post(f"{self.url}{path}", **kw) as r:
            status, body = r.status, await r.json(content_type=None)
        oracle.check(path, status, body)
        return status, dict(r.headers), body

    async def events(self, path: str, body: dict) -> tuple[int, dict, list]:
        """POST a streaming request; (status, headers, parsed `data:` events, with "[DONE]" kept as a string)."""
        async with self.http.post(f"{self.url}{path}", json={**body, "stream": True}) as r:
            buf = (await r.read()).decode()
        events = []
        for block in buf.split("\n\n"):
            if block.startswith("data: "):
                data = block[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                oracle.check_openai_chunk(path, events[-1])
        return r.status, dict(r.headers), events

    async def metric(self, name: str, **labels: str) -> float:
        """A sample's value from /metrics (0 when absent)."""
        async with self.http.get(f"{self.url}/metrics") as r:
            value = sample_value(await r.text(), name, **labels)
        return 0.0 if value is None else value

    async def wait_for(self, predicate, timeout: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not await predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError("condition not reached in time")
            await asyncio.sleep(0.05)


def chat_body(text: str = "What is the capital of France?", **kw) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": text}], **kw}


LONG_TEXT = "Please tell me about the history and geography of France in some detail. " * 4


@pytest.fixture
def empty_config(tmp_path, monkeypatch):
    """Point DISAGG_CONFIG at an empty TOML so the repo's config.toml never leaks into test settings."""
    path = tmp_path / "empty.toml"
    path.write_text("")
    monkeypatch.setenv("DISAGG_CONFIG", str(path))
    for key in list(os.environ):
        if key.startswith("DISAGG_") and key != "DISAGG_CONFIG":
            monkeypatch.delenv(key)
    return path


@pytest.fixture
async def cluster(empty_config):
    c = await Cluster().start()
    yield c
    await c.stop()


@pytest.fixture
async def local_cluster(empty_config):
    """A decode node and no prefill node: every request prefills locally."""
    c = await Cluster(n_prefill=0).start()
    yield c
    await c.stop()


async def chat_path(c: "Cluster") -> str:
    """A 60-word chat through the cluster's gateway: 200, and its x-disagg-path."""
    status, headers, body = await c.chat(chat_body("x " * 60))
    assert status == 200, body
    return headers["x-disagg-path"]


async def fidelity_row(c: "Cluster") -> dict:
    """The cluster's one fidelity pair row from the gateway's /health."""
    async with c.http.get(c.url + "/health") as r:
        (row,) = (await r.json())["fidelity"]
    return row
