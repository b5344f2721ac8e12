"""Client-facing APIs, one module group per API family (openai/, ollama/, anthropic/; vLLM's tokenization.py), each
parsing its requests and framing its answers; all of them end in the one orchestrator and relay (serving.py,
relay.py), behind each app's error and key boundary (boundary.py)."""
