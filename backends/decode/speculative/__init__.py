"""Speculative decoding on the decode node (docs/speculative.md): one generation's draft-verify step (step), the
drafters (prompt lookup, a draft model: drafters) and the controller that picks the draft length (control). May
import backends.decode's batch and sampling, and kv_bridge.config; nothing above decode/."""
