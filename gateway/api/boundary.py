"""Each aiohttp (sub-)app's boundary: the API-key check and the one place errors become responses, in its API's
shape (an `ErrorShape`, written in each API package's errors.py).
"""

from __future__ import annotations

import logging
from typing import Collection

from aiohttp import web

from gateway.auth import APIKeys, refusal
from gateway.errors import APIError

log = logging.getLogger("gateway")

def mine(request: web.Request) -> bool:
    """True when the app whose middleware runs is the one that resolved `request` (not one of its sub-apps).

    An app's middlewares also wrap its sub-apps' requests; those belong to the sub-app's own middlewares.
    """
    return request.match_info.apps[-1] is request.app


class ErrorShape:
    """How one API writes an error: `body` and `status` of an APIError, and what aiohttp's 404/405 say (each API's
    own wording, `{method}` and `{path}` filled in)."""

    not_found = "Not found: {method} {path}"
    not_allowed = "Method {method} is not allowed on {path}"

    def body(self, err: APIError) -> dict:
        raise NotImplementedError

    def status(self, err: APIError) -> int:
        return err.status

    def http_message(self, e: web.HTTPException, request: web.Request) -> str:
        wording = {404: self.not_found, 405: self.not_allowed}.get(e.status)
        return wording.format(method=request.method, path=request.path) if wording else (e.text or e.reason)

    def from_http(self, e: web.HTTPException, request: web.Request) -> APIError:
        return APIError(self.http_message(e, request), status=e.status)

    def response(self, err: APIError) -> web.Response:
        return web.json_response(self.body(err), status=self.status(err), headers=err.headers or None)


def error_middleware(shape: ErrorShape):
    """Everything a handler of this app raises (APIError, aiohttp's 404/405, a bug) answered in `shape`; a sub-app's
    own error middleware answers first, so its errors keep the sub-app's shape."""

    @web.middleware
    async def api_errors(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            return shape.response(e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            resp = shape.response(shape.from_http(e, request))
            if "Allow" in e.headers:
                resp.headers["Allow"] = e.headers["Allow"]
            return resp
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return shape.response(APIError("internal server error; see gateway logs"))

    return api_errors


def key_middleware(keys: APIKeys, open_handlers: Collection = ()):
    """A valid API key on every request of this app but those `open_handlers` answer: 401 before 404."""
    open_handlers = frozenset(open_handlers)

    @web.middleware
    async def require_api_key(request: web.Request, handler) -> web.StreamResponse:
        if mine(request) and request.match_info.handler not in open_handlers:
            problem = keys.check(request.headers.get("Authorization"), request.remote)
            if problem is not None:
                raise refusal(problem)  # the error middleware, outside this one, writes it in the API's shape
        return await handler(request)

    return require_api_key


def middlewares(shape: ErrorShape, keys: APIKeys | None, open_handlers: Collection = ()) -> list:
    """An app's boundary: its errors in `shape`, and (with keys configured) a key on every request of the app but
    those `open_handlers` answer; a refused caller gets the 401 in `shape` too."""
    if keys is None:
        return [error_middleware(shape)]
    return [error_middleware(shape), key_middleware(keys, open_handlers)]
