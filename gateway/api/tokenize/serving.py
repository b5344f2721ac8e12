"""vLLM's POST /tokenize and /detokenize with vLLM's request and response shapes: a prompt or chat messages (rendered
exactly as /v1/chat/completions renders them) to token ids, so a client can count a long prompt before sending it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from kv_bridge.config.models import ModelRoute

from gateway.api.protocol import parse, read_body
from gateway.api.serving import STATE, GatewayState
from gateway.api.tokenize.protocol import Detokenize, TokenizeChat, TokenizeCompletion
from gateway.errors import InvalidRequest
from gateway.text.history import template_messages
from gateway.text.tokenizer import ChatTokenizer


def _route(st: GatewayState, model: str | None) -> ModelRoute:
    if model is None:
        if len(st.settings.models) != 1:
            raise InvalidRequest("model is required: this gateway serves several models; see GET /v1/models",
                                 param="model")
        return st.settings.models[0]
    return st.route(model)


def _chat_ids(tok: ChatTokenizer, req: TokenizeChat) -> list[int]:
    """The prompt ids /v1/chat/completions would send for these messages."""
    if req.chat_template is not None:  # as vLLM without --trust-request-chat-template
        raise InvalidRequest("chat_template may not be set by a request: the model's own template is used",
                             param="chat_template")
    if req.continue_final_message:
        raise InvalidRequest("continue_final_message is not supported by this server",
                             param="continue_final_message")
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & {"messages", "tools", "documents", "add_generation_prompt"})
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    if req.tools and not tok.supports_tools:
        raise InvalidRequest("this model's chat template does not support tools", param="tools")
    msgs = template_messages([m.model_dump(exclude_none=False) for m in req.messages])
    text = tok.render(msgs, add_generation_prompt=req.add_generation_prompt, tools=req.tools or None, **kwargs)
    return tok.tokenizer.encode(text, add_special_tokens=req.add_special_tokens).ids


def _prompt_ids(tok: ChatTokenizer, req: TokenizeCompletion) -> list[int]:
    """A raw prompt, as /v1/completions tokenizes it (the tokenizer's own special tokens, e.g. BOS, by default)."""
    return tok.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens).ids


async def tokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = await read_body(request)
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    req = parse(TokenizeChat if "messages" in body else TokenizeCompletion, body)
    route = _route(st, req.model)
    tok = st.tokenizers[route.id]
    fn = _chat_ids if isinstance(req, TokenizeChat) else _prompt_ids
    # A 25k-token prompt takes milliseconds to tokenize: off the event loop, as the generation paths do.
    ids = await asyncio.get_running_loop().run_in_executor(None, fn, tok, req)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": route.max_model_len, "tokens": ids,
                           "token_strs": [tok.tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None}
    return web.json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    req = parse(Detokenize, await read_body(request))
    route = _route(st, req.model)
    tok = st.tokenizers[route.id]
    bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (size {tok.vocab_size})", param="tokens")
    return web.json_response({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})
