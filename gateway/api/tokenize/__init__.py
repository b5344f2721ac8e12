"""vLLM's /tokenize and /detokenize (vLLM's `entrypoints/serve/tokenize/`), on the gateway's root app."""
