"""Ollama's error shape, `{"error": "..."}` (the param, when there is one, is named in the message)."""

from __future__ import annotations

from gateway.api.boundary import ErrorShape
from gateway.errors import APIError


class OllamaShape(ErrorShape):
    not_found = "{method} {path} is not an Ollama API endpoint"
    not_allowed = "method {method} is not allowed on {path}"

    def body(self, err: APIError) -> dict:
        return {"error": f"unauthorized: {err.message}" if err.status == 401 else err.message}

    def status(self, err: APIError) -> int:
        return 500 if err.status == 502 else err.status  # Ollama: a node's failure is a 500


OLLAMA = OllamaShape()
