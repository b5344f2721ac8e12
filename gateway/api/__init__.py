"""Client-facing APIs, one package per API family (openai/ with responses/, anthropic/, ollama/; vLLM's tokenize/),
each with the same files for the same jobs: protocol.py (request models), translate.py (into the shared ChatRequest),
framing.py (answers), serving.py (handlers), errors.py (error shape), api_router.py (its app and `mount`). All of
them parse on protocol.py's base, prepare in chat_job.py and answer through serving.run and relay.py, behind each
app's error and key boundary (boundary.py)."""
