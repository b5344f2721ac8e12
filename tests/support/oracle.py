"""The published client types as oracles: every OpenAI and Ollama body a test receives is checked against the
`openai` and `ollama` packages' own pydantic models, so a shape drift fails every test that sees it at once."""

from __future__ import annotations

from typing import Any

import pydantic
from ollama._types import ChatResponse, GenerateResponse, ListResponse, ProcessResponse
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

# Fields we send beyond openai's types, on purpose and as vLLM's OpenAI server sends them (vllm/entrypoints/openai):
# `reasoning_content` on messages and deltas (vLLM's reasoning parsers), `stop_reason` on choices.
OPENAI_EXTENSIONS = {"reasoning_content", "reasoning", "stop_reason", "prompt_logprobs", "kv_transfer_params"}

OPENAI_BODIES = {"/v1/chat/completions": ChatCompletion, "/v1/completions": Completion}
OLLAMA_BODIES = {"/api/chat": ChatResponse, "/api/generate": GenerateResponse, "/api/tags": ListResponse,
                 "/api/ps": ProcessResponse}
# The ollama package types every field Optional; these are what its own CLI and our site's app read on every answer.
OLLAMA_REQUIRED = {"/api/chat": {"model", "created_at", "done", "message"},
                   "/api/generate": {"model", "created_at", "done", "response"}, "/api/tags": {"models"},
                   "/api/ps": {"models"}}


class OracleError(AssertionError):
    """A body that the published client types would not read as we mean it."""


def _extras(model: Any, where: str) -> list[str]:
    """Unknown fields anywhere in a validated openai model (openai's types allow extras silently)."""
    out: list[str] = []
    if isinstance(model, pydantic.BaseModel):
        out += [f"{where}.{k}" for k in (model.model_extra or {}) if k not in OPENAI_EXTENSIONS]
        for name in type(model).model_fields:
            out += _extras(getattr(model, name), f"{where}.{name}")
    elif isinstance(model, list):
        for i, item in enumerate(model):
            out += _extras(item, f"{where}[{i}]")
    return out


def _openai(kind: type[pydantic.BaseModel], body: Any, what: str) -> None:
    try:
        model = kind.model_validate(body, strict=True)
    except pydantic.ValidationError as e:
        raise OracleError(f"{what} is not an openai {kind.__name__}: {e}\n{body}") from None
    extra = _extras(model, kind.__name__)
    if extra:
        raise OracleError(f"{what}: fields openai's {kind.__name__} does not define: {extra}")


def _ollama_keys(kind: type[pydantic.BaseModel], body: dict, what: str) -> None:
    """The ollama package ignores unknown fields; a field it does not know is one its users never see."""
    known = {f.alias or name for name, f in kind.model_fields.items()}
    unknown = set(body) - known
    if unknown:
        raise OracleError(f"{what}: fields ollama's {kind.__name__} does not define: {sorted(unknown)}")
    message = body.get("message")
    if isinstance(message, dict):
        from ollama._types import Message

        _ollama_keys(Message, message, what + ".message")


def check_openai(path: str, status: int, body: Any) -> None:
    """A whole (non-streaming) answer from an OpenAI route: the right type on success, ErrorObject on failure."""
    if status >= 400:
        if isinstance(body, dict) and "error" in body:
            _openai(ErrorObject, body["error"], f"{path} {status} error")
        return
    if path in OPENAI_BODIES and isinstance(body, dict):
        _openai(OPENAI_BODIES[path], body, f"{path} body")


def check_openai_chunk(path: str, event: Any) -> None:
    """One `data:` event of a stream: a chunk, or an error event (the `[DONE]` sentinel is a string)."""
    if isinstance(event, str) or path not in OPENAI_BODIES:
        return
    if "error" in event:
        _openai(ErrorObject, event["error"], f"{path} stream error")
    elif path == "/v1/completions":
        # openai's SDK reads completion streams as `Completion`s, yet OpenAI's API sends finish_reason null until
        # the last chunk; the type says otherwise only because the SDK builds stream chunks without validating.
        choices = [{**c, "finish_reason": c.get("finish_reason") or "stop"} for c in event.get("choices") or []]
        _openai(Completion, {**event, "choices": choices}, f"{path} chunk")
    else:
        _openai(ChatCompletionChunk, event, f"{path} chunk")


def check_ollama(path: str, status: int, body: Any) -> None:
    """An Ollama answer (whole, or one NDJSON line of a stream): its type's fields, validated; an error is {error}."""
    is_error = isinstance(body, dict) and set(body) == {"error"}  # Ollama ends a broken stream with such a line too
    if status >= 400 or is_error:
        if not (is_error and isinstance(body["error"], str)):
            raise OracleError(f"{path} {status}: an Ollama error is {{\"error\": str}}, got {body}")
        return
    kind = OLLAMA_BODIES.get(path)
    if kind is None or not isinstance(body, dict):
        return
    missing = OLLAMA_REQUIRED[path] - set(body)
    if missing:
        raise OracleError(f"{path}: missing {sorted(missing)} in {body}")
    _ollama_keys(kind, body, path)
    try:
        kind.model_validate(body, strict=False)  # ollama's datetime fields arrive as strings
    except pydantic.ValidationError as e:
        raise OracleError(f"{path} is not an ollama {kind.__name__}: {e}\n{body}") from None


def check(path: str, status: int, body: Any) -> None:
    """Any gateway answer by route: the one entry every test helper calls."""
    path = path.split("?", 1)[0]
    if path.startswith("/api/"):
        check_ollama(path, status, body)
    elif path.startswith("/v1/"):
        check_openai(path, status, body)
