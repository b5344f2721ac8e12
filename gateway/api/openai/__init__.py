"""OpenAI's API: /v1/chat/completions, /v1/completions; request models (protocol.py) and response shapes (render.py)."""
