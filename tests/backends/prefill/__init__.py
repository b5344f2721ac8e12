"""Tests of backends/prefill: the prefill node's start-up memory decision (no engine starts)."""
