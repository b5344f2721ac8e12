"""The Anthropic app's boundary: errors as `{"type": "error", "error": {"type", "message"}}` and the API key taken
from `x-api-key` (Anthropic's clients) or `Authorization: Bearer` (gateways and proxies)."""

from __future__ import annotations

from aiohttp import web

from gateway.auth import APIKeys, AuthenticationError
from gateway.api.boundary import ErrorShape, error_middleware, mine
from gateway.errors import APIError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
          529: "overloaded_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(err: APIError) -> dict:
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


class AnthropicShape(ErrorShape):
    def body(self, err: APIError) -> dict:
        return error_body(err)


ANTHROPIC = AnthropicShape()


def _key_middleware(keys: APIKeys):
    @web.middleware
    async def require_api_key(request: web.Request, handler) -> web.StreamResponse:
        if mine(request):
            key = request.headers.get("x-api-key")
            problem = keys.check(f"Bearer {key}" if key else request.headers.get("Authorization"), request.remote)
            if problem == "missing":
                raise AuthenticationError("x-api-key header is required (or Authorization: Bearer YOUR_KEY)")
            if problem is not None:
                raise AuthenticationError("invalid x-api-key")  # never echoed: it may be another service's key
        return await handler(request)

    return require_api_key


def middlewares(keys: APIKeys | None) -> list:
    """Errors in Anthropic's shape, and (with keys configured) a key on every request, refused in that shape."""
    return [error_middleware(ANTHROPIC)] + ([] if keys is None else [_key_middleware(keys)])
