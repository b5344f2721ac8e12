"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}` (gateway.errors.APIError.body); the
gateway's root app answers in it too."""

from __future__ import annotations

from aiohttp import web

from gateway.api.boundary import ErrorShape
from gateway.errors import APIError

_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class OpenAIShape(ErrorShape):
    not_found = "Unknown request URL: {method} {path}"

    def body(self, err: APIError) -> dict:
        return err.body()

    def from_http(self, e: web.HTTPException, request: web.Request) -> APIError:
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return APIError(self.http_message(e, request), status=e.status, type=kind, code=_CODES.get(e.status))


OPENAI = OpenAIShape()
