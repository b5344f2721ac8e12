"""OpenAI-compatible HTTP front for disagg: templating, routing to prefill/decode nodes over HTTP, metrics.

Never imports torch, vllm, mlx or backends/; entry points are `gateway.app.create_app` and `gateway.app.serve`.
"""
