"""Ollama's error shape, `{"error": "..."}` (the param, when there is one, is named in the message)."""

from __future__ import annotations

from gateway.api.boundary import ErrorShape
from gateway.errors import APIError, ServerBusy

# Ollama's own words when its queue (OLLAMA_MAX_QUEUE, 512) is full, answered 503 (server/sched.go ErrMaxQueue).
MAX_QUEUE = "server busy, please try again.  maximum pending requests exceeded"


class OllamaShape(ErrorShape):
    not_found = "{method} {path} is not an Ollama API endpoint"
    not_allowed = "method {method} is not allowed on {path}"

    def body(self, err: APIError) -> dict:
        if isinstance(err, ServerBusy):
            detail = err.message.removeprefix("server busy: ")
            return {"error": MAX_QUEUE if err.reason == "full" else f"server busy, please try again.  {detail}"}
        return {"error": f"unauthorized: {err.message}" if err.status == 401 else err.message}

    def status(self, err: APIError) -> int:
        if isinstance(err, ServerBusy):
            return 503  # Ollama's busy answer; OpenAI and Anthropic answer 429
        return 500 if err.status == 502 else err.status  # Ollama: a node's failure is a 500


OLLAMA = OllamaShape()
