"""vLLM side of the KV bridge: the KV-connector plugin, KV extraction and paged-cache layouts (the only torch code).

Imports nothing heavy itself: `kv_bridge.vllm.layouts` is numpy only; torch and vLLM load with the connector.
"""
