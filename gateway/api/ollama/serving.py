"""Ollama's handlers: /, /api/version, /api/tags, /api/ps, /api/show (from the model cards), and /api/generate and
/api/chat through the shared request path (translate.py) and relay (framing.py)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

from aiohttp import web

from kv_bridge.config.models import ModelRoute

from gateway.api.ollama.cards import CARDS, ModelCard
from gateway.api.ollama.framing import Clock, OllamaFraming, chunk
from gateway.api.ollama.protocol import ChatBody, GenerateBody, Job, ShowBody
from gateway.api.ollama.translate import chat_job, find_route, generate_job
from gateway.api.protocol import parse, read_body
from gateway.api.serving import STATE, GatewayState, endpoint, run
from gateway.cluster.upstream import Prompt
from gateway.errors import InvalidRequest, NoHealthyNode
from gateway.metrics import RequestRecord
from gateway.text.reasoning import parser_name

# Plain semver: clients compare it, and a pre-release suffix ("-disagg") would sort below the release.
VERSION = "0.9.0"


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
    body = parse(ShowBody, await read_body(request))
    name = body.model or body.name
    if not name:
        raise InvalidRequest("model is required", param="model")
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
