"""Client-facing APIs: one module group per API family (openai/, ollama/), the error/key boundary of each app,
and what every handler shares (serving.py: state, metrics wrapper, `run`; relay.py: generations -> a client)."""
