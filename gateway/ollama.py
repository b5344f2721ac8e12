"""The gateway as an Ollama drop-in: /, /api/version, /api/tags, /api/show, /api/ps, /api/generate, /api/chat.

`add_routes(app)` registers them and an error middleware that answers Ollama paths with `{"error": "..."}`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import struct
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from aiohttp import web

from kv_bridge.config import ModelRoute, resolve_model_path

from .errors import APIError, ClientDisconnected, InvalidRequest, NoHealthyNode, is_ollama_path
from .metrics import RequestRecord
from .ollama_schemas import Clock, Job, chunk, final, find_route, parse_chat, parse_generate, read_json
from .serving import STATE, GatewayState, endpoint
from .upstream import Prompt

log = logging.getLogger("gateway.ollama")

# Plain semver: clients compare it, and a pre-release suffix ("-disagg") would sort below the release.
VERSION = "0.9.0"
_MAX_HEADER_BYTES = 100 << 20  # a safetensors JSON header larger than this is not a model we made
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".npz")


@dataclass(frozen=True)
class ModelCard:
    """What Ollama's model endpoints report for one configured model, read from its folder at start-up."""

    id: str
    folder: Path
    size: int
    digest: str
    modified_at: str
    details: dict
    model_info: dict
    template: str
    vocab_size: int | None


CARDS = web.AppKey("disagg_ollama_cards", dict)


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _human_number(n: int) -> str:
    """Ollama's parameter_size style: 134.52M, 7.6B, 8B."""
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2), ("K", 1e3, 0)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f}{unit}" if x == int(x) else f"{x:.{digits}f}{unit}"
    return str(n)


def _safetensors_params(folder: Path) -> tuple[int, str]:
    """(parameter count, the dtype most parameters have) from the safetensors headers; no weights are read."""
    total, by_dtype = 0, {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n)) if n <= _MAX_HEADER_BYTES else {}
        except (OSError, ValueError, struct.error):
            continue
        for name, t in header.items():
            if name != "__metadata__" and isinstance(t, dict):
                count = math.prod(t.get("shape") or [])
                total += count
                by_dtype[t.get("dtype", "")] = by_dtype.get(t.get("dtype", ""), 0) + count
    return total, max(by_dtype, key=by_dtype.get, default="")


def _template_text(folder: Path) -> str:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tpl = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) else ""


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _model_info(cfg: dict, params: int) -> dict:
    """Ollama's GGUF-style keys, from the HF config.json."""
    arch = str(cfg.get("model_type") or "unknown")
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    keys = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
            "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
            "attention.key_length": "head_dim", "attention.value_length": "head_dim",
            "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
            "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"}
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": params}
    info.update({f"{arch}.{k}": cfg[src] for k, src in keys.items() if cfg.get(src) is not None})
    if rope is not None:
        info[f"{arch}.rope.freq_base"] = rope
    return info


def build_card(route: ModelRoute) -> ModelCard:
    folder = resolve_model_path(route)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    cfg = _read_json(folder / "config.json")
    params, dtype = _safetensors_params(folder)
    # Identity of the weights without hashing gigabytes: config.json plus each weight file's name and size.
    h = hashlib.sha256((folder / "config.json").read_bytes() if (folder / "config.json").is_file() else b"")
    for p in files:
        if p.suffix in _WEIGHT_SUFFIXES:
            h.update(f"\n{p.relative_to(folder)}:{p.stat().st_size}".encode())
    quant = cfg.get("quantization_config") or cfg.get("quantization") or {}
    if quant:
        level = str(quant.get("quant_method") or f"Q{quant.get('bits', '')}").upper()
    else:
        level = dtype.upper()
    family = str(cfg.get("model_type") or "unknown")
    details = {"parent_model": "", "format": "safetensors", "family": family, "families": [family],
               "parameter_size": _human_number(params), "quantization_level": level}
    return ModelCard(
        id=route.id, folder=folder, size=sum(p.stat().st_size for p in files), digest=h.hexdigest(),
        modified_at=_rfc3339(max((p.stat().st_mtime for p in files), default=time.time())), details=details,
        model_info=_model_info(cfg, params), template=_template_text(folder), vocab_size=cfg.get("vocab_size"),
    )


# ---- the error boundary for Ollama paths ----

def _error(message: str, status: int, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


@web.middleware
async def ollama_errors(request: web.Request, handler) -> web.StreamResponse:
    """Ollama clients read `{"error": "..."}`; it runs inside the OpenAI middleware, so it sees errors first."""
    if not is_ollama_path(request.path):
        return await handler(request)
    try:
        return await handler(request)
    except APIError as e:
        return _error(e.message, 500 if e.status == 502 else e.status, e.headers)  # Ollama: node failures are 500
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            msg = f"{request.method} {request.path} is not an Ollama API endpoint"
        elif e.status == 405:
            msg = f"method {request.method} is not allowed on {request.path}"
        else:
            msg = e.text or e.reason
        resp = _error(msg, e.status)
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error("internal server error; see gateway logs", 500)


# ---- model endpoints ----

async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


def _summary(card: ModelCard) -> dict:
    return {"name": card.id, "model": card.id, "size": card.size, "digest": card.digest, "details": card.details}


async def tags(request: web.Request) -> web.Response:
    cards = request.app[CARDS]
    return web.json_response({"models": [{**_summary(c), "modified_at": c.modified_at} for c in cards.values()]})


async def ps(request: web.Request) -> web.Response:
    """Models with a healthy decode node; they stay loaded, so they never expire (as Ollama's keep_alive -1)."""
    st, cards = request.app[STATE], request.app[CARDS]
    expires = (datetime.now(timezone.utc) + timedelta(days=365 * 100)).strftime("%Y-%m-%dT%H:%M:%SZ")
    models = [{**_summary(cards[m.id]), "expires_at": expires, "size_vram": 0, "context_length": m.max_model_len}
              for m in st.settings.models if st.pool.healthy(m.decode)]
    return web.json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    name = body.get("model") or body.get("name")  # "name": the field's pre-0.1 spelling, still accepted
    if not isinstance(name, str) or not name:
        raise InvalidRequest("model is required")
    st = request.app[STATE]
    route = find_route(st, name)
    card = request.app[CARDS][route.id]
    params = {"num_ctx": str(route.max_model_len)}
    eos = st.tokenizers[route.id].special_tokens.get("eos_token")
    if eos:
        params["stop"] = json.dumps(eos)
    parameters = "\n".join(f"{k:<30} {v}" for k, v in params.items())
    modelfile = (f"# Modelfile for {card.id}, served by disagg\n\nFROM {card.folder}\n"
                 f'TEMPLATE """{card.template}"""\n' + "".join(f"PARAMETER {k} {v}\n" for k, v in params.items()))
    return web.json_response({
        "modelfile": modelfile, "parameters": parameters, "template": card.template, "details": card.details,
        "model_info": card.model_info, "capabilities": ["completion"], "modified_at": card.modified_at,
    })


# ---- generation: POST /api/generate and /api/chat ----

async def _generate(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    vocab = {mid: c.vocab_size for mid, c in request.app[CARDS].items()}
    return await _serve(request, st, rec, await parse_generate(request, st, vocab))


async def _chat(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    return await _serve(request, st, rec, await parse_chat(request, st))


async def _serve(request: web.Request, st: GatewayState, rec: RequestRecord, job: Job) -> web.StreamResponse:
    """Counted in disagg_requests_total like the OpenAI path (serving.endpoint); load/unload replies generate
    nothing and are not counted."""
    rec.model = job.route.id
    if job.prompt is None:
        resp = _load_reply(st, job)
        rec.skip()
        return resp
    return await _run(request, st, rec, job)


generate = endpoint(_generate)
chat = endpoint(_chat)


def _load_reply(st: GatewayState, job: Job) -> web.Response:
    """Ollama's answer to an empty prompt: the model is loaded (ours always are, where a decode node is up)."""
    if not st.pool.healthy(job.route.decode):
        raise NoHealthyNode(f"no healthy decode node for model '{job.name}'; retry later")
    body = chunk(job, "")
    body.update(done=True, done_reason=job.load_reason)
    return web.json_response(body)


async def _run(request: web.Request, st: GatewayState, rec: RequestRecord, job: Job) -> web.StreamResponse:
    assert st.orchestrator is not None and job.prompt is not None and job.sampling is not None, "app not started"
    clock = Clock(rec.t0, t_gen=time.monotonic())
    rec.started(job.route.id)
    gen = await st.orchestrator.start(job.route, Prompt(job.prompt, job.upstream), job.sampling)
    rec.path = gen.planned_path
    try:
        if job.stream:
            return await _stream(request, job, gen, rec, clock)
        return await _complete(request, job, gen, rec, clock)
    finally:
        await gen.close()


async def _complete(request: web.Request, job: Job, gen, rec: RequestRecord, clock: Clock) -> web.Response:
    parts, ids = [], []
    async for tok in gen.tokens():
        rec.token()
        clock.token()
        parts.append(tok.text)
        if tok.token_id >= 0:  # upstream tokens (-1) are not ours; they cannot go into `context`
            ids.append(tok.token_id)
        if request.transport is None or request.transport.is_closing():
            # Nobody will read the answer: stop, and closing the decode stream stops the node too.
            raise ClientDisconnected("client closed the connection")
    clock.t_end = time.monotonic()
    await gen.close()  # settles the prefill call, whose wall time goes into the headers
    assert gen.done is not None
    rec.path = gen.path
    rec.generation_done(gen.done, gen.prefill_s)
    return web.json_response(final(job, "".join(parts), gen.done, clock, ids), headers=gen.headers())


def _ndjson(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


async def _stream(request: web.Request, job: Job, gen, rec: RequestRecord, clock: Clock) -> web.StreamResponse:
    resp = web.StreamResponse(headers={
        "Content-Type": "application/x-ndjson", "x-disagg-path": str(gen.planned_path),
        "x-disagg-decode-node": gen.decode.name,
    })
    try:
        await resp.prepare(request)
    except ConnectionResetError:
        status = "cancelled"
    else:
        status = await _relay(resp, job, gen, rec, clock)
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    # The client has its answer; now settle the prefill call (for its metric) and close the upstream stream.
    await gen.close()
    rec.path = gen.path
    if status == "ok" and gen.done is not None:
        rec.generation_done(gen.done, gen.prefill_s)
    rec.finish(status)
    return resp


async def _relay(resp: web.StreamResponse, job: Job, gen, rec: RequestRecord, clock: Clock) -> str:
    """Write every line; return the outcome label. Nothing raised here may escape: the headers are sent."""
    ids = []
    try:
        async for tok in gen.tokens():
            rec.token()
            clock.token()
            if tok.token_id >= 0:  # upstream tokens (-1) are not ours; they cannot go into `context`
                ids.append(tok.token_id)
            if tok.text:  # a token that ends mid-codepoint has no text yet; the next one carries it
                await resp.write(_ndjson(chunk(job, tok.text)))
        clock.t_end = time.monotonic()
        assert gen.done is not None
        await resp.write(_ndjson(final(job, "", gen.done, clock, ids)))
        return "ok"
    except ConnectionResetError:
        log.info("client went away during %s; closing the decode stream", gen.request_id)
        return "cancelled"
    except APIError as e:
        log.warning("stream %s failed: %s", gen.request_id, e.message)
        message = e.message
    except Exception:
        log.exception("stream %s failed", gen.request_id)
        message = "internal error while streaming; see gateway logs"
    with contextlib.suppress(ConnectionResetError):
        await resp.write(_ndjson({"error": message}))  # Ollama's mid-stream failure: a last line with "error"
    return "error"


def add_routes(app: web.Application) -> None:
    """Register the Ollama API on the gateway app (after app[STATE] is set) and its error middleware."""
    st = app[STATE]
    app[CARDS] = {m.id: build_card(m) for m in st.settings.models}
    app.middlewares.append(ollama_errors)
    r = app.router
    r.add_get("/", root)  # add_get answers HEAD too
    r.add_get("/api/version", version)
    r.add_get("/api/tags", tags)
    r.add_get("/api/ps", ps)
    r.add_post("/api/show", show)
    r.add_post("/api/generate", generate)
    r.add_post("/api/chat", chat)
