"""The gateway as an Ollama drop-in: /, /api/version, /api/tags, /api/show, /api/ps, /api/generate, /api/chat.

`api_app` is the /api sub-app (errors as `{"error": "..."}`, gateway.api.boundary); `root` is served by the gateway app.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from aiohttp import web

from kv_bridge.config import ModelRoute, resolve_model_path

from gateway.api import boundary
from gateway.auth import APIKeys
from gateway.errors import APIError, InvalidRequest, NoHealthyNode
from gateway.metrics import RequestRecord
from gateway.api.ollama.protocol import ChatBody, Clock, GenerateBody, Job, chunk, final, find_route
from gateway.api.ollama.translate import chat_job, generate_job
from gateway.api.protocol import parse, read_body
from gateway.text.reasoning import parser_name
from gateway.api.relay import Framing, ndjson
from gateway.api.serving import STATE, GatewayState, endpoint, run
from gateway.cluster.upstream import Prompt

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


# ---- model endpoints ----

async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


def _summary(card: ModelCard, name: str | None = None) -> dict:
    name = name or card.id
    return {"name": name, "model": name, "size": card.size, "digest": card.digest, "details": card.details}


async def tags(request: web.Request) -> web.Response:
    """Every name a model answers to: its id and its aliases (config.toml), the same card under each."""
    st, cards = request.app[STATE], request.app[CARDS]
    return web.json_response({"models": [{**_summary(cards[m.id], name), "modified_at": cards[m.id].modified_at}
                                         for m in st.settings.models for name in m.names]})


async def ps(request: web.Request) -> web.Response:
    """Models with a healthy decode node; they stay loaded, so they never expire (as Ollama's keep_alive -1)."""
    st, cards = request.app[STATE], request.app[CARDS]
    expires = (datetime.now(timezone.utc) + timedelta(days=365 * 100)).strftime("%Y-%m-%dT%H:%M:%SZ")
    models = [{**_summary(cards[m.id]), "expires_at": expires, "size_vram": 0, "context_length": m.max_model_len}
              for m in st.settings.models if st.pool.healthy(m.decode)]
    return web.json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    body = await read_body(request)
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
        "model_info": card.model_info, "capabilities": capabilities(st, route), "modified_at": card.modified_at,
    })


def capabilities(st: GatewayState, route: ModelRoute) -> list[str]:
    """What Ollama's clients check before they offer a feature (VS Code offers tools only when listed): tools when
    the chat template renders them, thinking when the model's family (or config) has a reasoning parser."""
    tok = st.tokenizers[route.id]
    out = ["completion"]
    if tok.supports_tools:
        out.append("tools")
    if parser_name(route.reasoning_parser, tok.model_type) is not None:
        out.append("thinking")
    return out


# ---- generation: POST /api/generate and /api/chat ----

async def _generate(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    body = parse(GenerateBody, await read_body(request))
    vocab = request.app[CARDS][find_route(st, body.model).id].vocab_size
    return await _serve(request, st, rec, await generate_job(st, body, vocab))


async def _chat(request: web.Request, st: GatewayState, rec: RequestRecord) -> web.StreamResponse:
    return await _serve(request, st, rec, await chat_job(st, parse(ChatBody, await read_body(request))))


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
    assert job.prompt is not None and job.sampling is not None
    framing = OllamaFraming(job, Clock(rec.t0, t_gen=time.monotonic()))
    return await run(request, st, rec, job.route, Prompt(job.prompt, job.upstream), job.sampling, 1, job.stream,
                     framing)


class OllamaFraming(Framing):
    """Ollama's answer: one JSON object with the whole text and its timings, or NDJSON chunks ending in that object
    (a last `{"error": ...}` line when it fails mid-stream)."""

    stream_headers = {"Content-Type": "application/x-ndjson"}
    encode = staticmethod(ndjson)

    def __init__(self, job: Job, clock: Clock) -> None:
        self.job, self.clock = job, clock
        self.parts: list[str] = []
        self.ids: list[int] = []  # for `context`

    def _count(self, tok) -> None:
        self.clock.token()
        if tok.token_id >= 0:  # upstream tokens (-1) are not ours; they cannot go into `context`
            self.ids.append(tok.token_id)

    def keep(self, index: int, tok) -> None:
        self._count(tok)
        self.parts.append(tok.text)

    def ended(self, index: int, done) -> None:
        self.clock.t_end = time.monotonic()

    def body(self, dones: list) -> dict:
        return final(self.job, "".join(self.parts), dones[0], self.clock, self.ids)

    def token(self, index: int, tok) -> dict | None:
        self._count(tok)
        # A token that ends mid-codepoint has no text yet; the next one carries it.
        return chunk(self.job, tok.text) if tok.text else None

    def finish(self, index: int, done) -> dict:
        self.clock.t_end = time.monotonic()
        return final(self.job, "", done, self.clock, self.ids)

    def error(self, err: APIError) -> list[dict]:
        return [{"error": err.message}]  # Ollama's mid-stream failure: a last line with "error"


def api_app(st: GatewayState, keys: APIKeys | None) -> web.Application:
    """The Ollama API, mounted at /api, with its own error shape and key check (gateway.api.boundary). Ollama's root
    route (`root`, "Ollama is running") lives on the gateway app: aiohttp mounts no sub-app at "/"."""
    app = web.Application(middlewares=boundary.middlewares(boundary.OLLAMA, keys))
    app[STATE] = st
    app[CARDS] = {m.id: build_card(m) for m in st.settings.models}
    r = app.router
    r.add_get("/version", version)
    r.add_get("/tags", tags)
    r.add_get("/ps", ps)
    r.add_post("/show", show)
    r.add_post("/generate", generate)
    r.add_post("/chat", chat)
    return app
