"""Ollama's API (/api/*): routes.py answers, protocol.py validates requests and builds Ollama's answer shapes."""
