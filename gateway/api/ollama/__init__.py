"""Ollama's API (/ and /api/*) over the shared request path: a drop-in for Ollama's clients."""
