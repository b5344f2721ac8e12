"""The one relay from generations to a client, for every API: a JSON body, or a stream of frames (OpenAI's
server-sent events, Ollama's NDJSON lines). What differs between the APIs is a `Framing`."""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from aiohttp import web

from kv_bridge.protocol import DoneLine, TokenLine

from gateway.errors import APIError, ClientDisconnected, status_class
from gateway.metrics import RequestRecord
from gateway.cluster.orchestrator import Choices

log = logging.getLogger("gateway.api.serving")

Frame = Any  # a JSON object (or, for SSE, the string "[DONE]"); `Framing.encode` makes it bytes


class Framing:
    """How one API frames an answer. Complete: `keep` each token and `ended` per choice, then `body`. Streamed:
    `opening`, a `token` and a `finish` frame per choice (None: nothing to write), `closing`; `error` frames when it
    fails after the headers went out."""

    stream_headers: dict[str, str] = {}
    # Written when a stream opens before its first token (the request waits in the gateway's queue): SSE allows a
    # comment line, which every SSE client skips; NDJSON has no such line, so Ollama's stream shows headers only.
    waiting: bytes = b""

    def encode(self, frame: Frame) -> bytes:
        raise NotImplementedError

    def keep(self, index: int, tok: TokenLine) -> None:
        raise NotImplementedError

    def ended(self, index: int, done: DoneLine) -> None:
        """A choice finished (complete answers): before the generations are closed."""

    def body(self, dones: list[DoneLine]) -> dict:
        raise NotImplementedError

    def opening(self, n: int) -> list[Frame]:
        return []

    def token(self, index: int, tok: TokenLine) -> Frame | None:
        raise NotImplementedError

    def finish(self, index: int, done: DoneLine) -> Frame | None:
        raise NotImplementedError

    def closing(self, dones: list[DoneLine]) -> list[Frame]:
        return []

    def error(self, err: APIError) -> list[Frame]:
        raise NotImplementedError


def _record(rec: RequestRecord, choices: Choices) -> None:
    rec.path = choices.first.path
    for g in choices.gens:
        if g.done is not None:
            rec.generation_done(g.done, g.prefill_s)


def _dones(choices: Choices) -> list[DoneLine]:
    dones = choices.dones
    assert all(d is not None for d in dones)
    return dones


async def complete(request: web.Request, choices: Choices, framing: Framing, rec: RequestRecord) -> web.Response:
    """Every choice to its end, then one JSON body with the node headers."""
    async for index, tok in choices.events():
        if tok is None:
            framing.ended(index, choices.gens[index].done)
            continue
        rec.token()
        framing.keep(index, tok)
        if request.transport is None or request.transport.is_closing():
            # Nobody will read the answer: stop, and closing the decode streams stops the nodes too.
            raise ClientDisconnected("client closed the connection")
    await choices.close()  # settles the prefill calls, whose wall time goes into the headers
    _record(rec, choices)
    return web.json_response(framing.body(_dones(choices)), headers=choices.headers())


class EarlyStream:
    """A streaming request's response opened before its generation starts, because it waits in the gateway's queue:
    the client has its headers (`x-disagg-queued: true`) at once and its first token when the request runs."""

    def __init__(self, request: web.Request, framing: Framing) -> None:
        self.request, self.framing = request, framing
        self.resp: web.StreamResponse | None = None

    async def open(self) -> None:
        if self.resp is not None:  # one response for all n choices
            return
        self.resp = web.StreamResponse(headers={**self.framing.stream_headers, "x-disagg-queued": "true"})
        try:
            await self.resp.prepare(self.request)
            if self.framing.waiting:
                await self.resp.write(self.framing.waiting)
        except ConnectionResetError:
            raise ClientDisconnected("client closed the connection while its request was queued") from None

    async def fail(self, err: APIError, rec: RequestRecord) -> web.StreamResponse:
        """The request never started (busy past the queue's bounds, client gone): its error in the stream's framing."""
        assert self.resp is not None
        with contextlib.suppress(ConnectionResetError):
            if not isinstance(err, ClientDisconnected):
                for frame in self.framing.error(err):
                    await self.resp.write(self.framing.encode(frame))
            await self.resp.write_eof()
        rec.finish("cancelled" if isinstance(err, ClientDisconnected) else status_class(err.status))
        return self.resp


async def stream(request: web.Request, choices: Choices, framing: Framing, rec: RequestRecord,
                 resp: web.StreamResponse | None = None) -> web.StreamResponse:
    """Frames as the tokens arrive; the request's outcome is recorded here (the headers went out before it).
    `resp`: the response already opened while the request was queued (EarlyStream)."""
    gen = choices.first
    status = ""
    if resp is None:
        resp = web.StreamResponse(headers={**framing.stream_headers, "x-disagg-path": str(gen.planned_path),
                                           "x-disagg-decode-node": gen.decode.name})
        try:
            await resp.prepare(request)
        except ConnectionResetError:
            status = "cancelled"
    if not status:
        status = await _relay(resp, choices, framing, rec)
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    # The client has its answer; now settle the prefill calls (for their metric) and close the upstream streams.
    await choices.close()
    if status == "ok":
        _record(rec, choices)
    else:
        rec.path = gen.path
    rec.finish(status)
    return resp


async def _relay(resp: web.StreamResponse, choices: Choices, framing: Framing, rec: RequestRecord) -> str:
    """Write every frame; return the outcome label. Nothing raised here may escape: the headers are sent."""
    try:
        for frame in framing.opening(choices.n):
            await resp.write(framing.encode(frame))
        async for index, tok in choices.events():
            if tok is None:
                frame = framing.finish(index, choices.gens[index].done)
            else:
                rec.token()
                frame = framing.token(index, tok)
            if frame is not None:
                await resp.write(framing.encode(frame))
        for frame in framing.closing(_dones(choices)):
            await resp.write(framing.encode(frame))
        return "ok"
    except ConnectionResetError:
        log.info("client went away during %s; closing the decode streams", choices.first.request_id)
        return "cancelled"
    except APIError as e:
        log.warning("stream %s failed: %s", choices.first.request_id, e.message)
        err = e
    except Exception:
        log.exception("stream %s failed", choices.first.request_id)
        err = APIError("internal error while streaming; see gateway logs")
    with contextlib.suppress(ConnectionResetError):
        for frame in framing.error(err):
            await resp.write(framing.encode(frame))
    return "error"


def sse(frame: Frame) -> bytes:
    data = frame if isinstance(frame, str) else json.dumps(frame, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def ndjson(frame: Frame) -> bytes:
    return (json.dumps(frame, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
