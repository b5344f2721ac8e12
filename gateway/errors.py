"""The gateway's one exception tree.

Everything a handler raises is an `APIError`; each app's middleware (gateway.api.boundary) writes it in its API's shape.
"""

from __future__ import annotations


class APIError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = dict(headers or {})  # extra response headers, e.g. Retry-After
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    """The request itself is wrong (bad JSON, a missing or out-of-range field)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class ModelNotFound(APIError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NoHealthyNode(APIError):
    """No node of the needed role answers its health check; retrying later may work."""

    status = 503
    type = "server_error"
    code = "no_healthy_node"

    def __init__(self, message: str, retry_after_s: int = 2) -> None:
        # A node that is down is usually being restarted (`disagg up` supervises); 2 s is a health poll.
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})


class RateLimited(APIError):
    """The model (or every node that could serve it) is at its in-flight limit; `Retry-After` says when to retry."""

    status = 429
    type = "requests"  # OpenAI's type for request-count rate limits
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class ServerBusy(RateLimited):
    """Past the gateway's queue: `max_queued` requests already wait for the model, or this one waited `max_wait_s`.
    OpenAI and Anthropic answer it 429, Ollama 503 "server busy" (its answer when OLLAMA_MAX_QUEUE is full)."""

    code = "server_busy"

    def __init__(self, message: str, retry_after_s: int, reason: str = "full") -> None:
        super().__init__(message, retry_after_s)
        self.reason = reason  # "full": max_queued already wait; "wait": this one waited max_wait_s


class UpstreamError(APIError):
    """A node failed or broke the protocol after we reached it."""

    status = 502
    type = "server_error"
    code = "upstream_error"


class NodeUnavailable(UpstreamError):
    """A node could not be reached (or said it is loading); the orchestrator fails over on this."""

    status = 503
    code = "node_unavailable"


class NodeBusy(UpstreamError):
    """A node refused work for now (429: e.g. its in-flight KV cap); another node may take it."""

    status = 429


class ClientDisconnected(APIError):
    """The client hung up before its answer was ready; nobody reads this, it only unwinds the request."""

    status = 499  # nginx's "client closed request"
    type = "invalid_request_error"
    code = "client_closed"


def status_class(status: int) -> str:
    """Metric label for an HTTP status: '4xx' or '5xx' keeps `disagg_requests_total` bounded."""
    return f"{status // 100}xx"

