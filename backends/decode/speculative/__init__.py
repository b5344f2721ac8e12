"""Speculative decoding on the decode node (docs/speculative.md): one generation's draft-verify step (step), the
drafting sources' interface and registry (sources), the drafters (prompt lookup, a draft model: drafters), the
controller choosing source and draft length (control) at the verify cost the node measures (verify_cost). May import
backends.decode's batch and sampling, and kv_bridge.config; nothing above decode/."""
