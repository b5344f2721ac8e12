"""What every client API's requests share: the pydantic base, sampling's bounds, the JSON body, and the one
translation of a validation error into an `InvalidRequest` whose `param` names the field as OpenAI writes it
(`messages[0].content`, `options.temperature`); each API's boundary writes that error in its own shape.
"""

from __future__ import annotations

import json
import typing
from typing import Annotated, Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import InvalidRequest


class APIModel(BaseModel):
    """The base of every API's request models: unknown fields are kept (clients send extras), never infinities."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# Sampling's bounds, once for every API (the decode node checks its own at its boundary, kv_bridge.protocol).
# An API narrows one where its documentation does (OpenAI's temperature <= 2, Anthropic's <= 1).
Temperature = Annotated[float, Field(ge=0.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0)]  # 0: off
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence and frequency
RepetitionPenalty = Annotated[float, Field(gt=0.0)]  # 1: off
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP = 4
MAX_LOGIT_BIAS = 100


def _models(tp: Any, seen: set) -> None:
    """Every pydantic model reachable from the annotation `tp` (unions, lists, dicts, Annotated), into `seen`."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if tp not in seen:
            seen.add(tp)
            for f in tp.model_fields.values():
                _models(f.annotation, seen)
        return
    for arg in typing.get_args(tp):
        _models(arg, seen)


def field_names(model: type[BaseModel]) -> frozenset[str]:
    seen: set = set()
    _models(model, seen)
    return frozenset(name for m in seen for name in m.model_fields)


def param_of(loc: tuple, names: frozenset[str]) -> str | None:
    """A pydantic error location as the `param` every API names: ('messages', 0, 'content', 'str') ->
    'messages[0].content'. A part that is no field (a union member's tag such as 'str') ends it: the field above
    it is the param."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in names:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def invalid(e: ValidationError, model: type[BaseModel]) -> InvalidRequest:
    """The first validation error as a 400 naming its param, for every API (its boundary writes the shape)."""
    err = e.errors()[0]
    param = param_of(tuple(err["loc"]), field_names(model))
    if err["type"] == "missing" and param:
        return InvalidRequest(f"{param} is required", param=param)
    return InvalidRequest(f"{param or 'body'}: {err['msg']}", param=param)


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: Any) -> M:
    """A JSON body as `model`; any validation error is `invalid`'s 400."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise invalid(e, model) from None


def parse_json(raw: bytes) -> Any:
    if not raw.strip():
        raise InvalidRequest("missing request body")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"invalid JSON in request body: {e}") from None
    except RecursionError:  # deeper nesting than the parser's stack: no valid request is that deep
        raise InvalidRequest("invalid JSON in request body: nested too deeply") from None


async def read_body(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise InvalidRequest("request body is too large", status=413, code="request_too_large") from None
    return parse_json(raw)

