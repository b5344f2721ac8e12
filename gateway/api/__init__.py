"""Client-facing APIs: each API family parses its requests and frames its answers; all of them end in the one
orchestrator and relay."""
