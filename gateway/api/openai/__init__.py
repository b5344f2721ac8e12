"""OpenAI's APIs: /v1/chat/completions, /v1/completions and /v1/models (protocol.py: requests, the shared
ChatRequest; framing.py: answers; serving.py: handlers) and /v1/responses (responses/)."""
