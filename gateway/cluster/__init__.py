"""Node-facing code: node pool and health, admission, path choice by learned rates, one generation across a
prefill and a decode node, mid-stream failover, the upstream fallback. Knows nothing of client API shapes."""
