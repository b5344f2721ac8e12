"""OpenAI's APIs: /v1/chat/completions, /v1/completions (protocol.py: requests; render.py: answers) and
/v1/responses (responses/)."""
