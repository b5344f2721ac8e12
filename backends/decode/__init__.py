"""The decode node (mlx-lm): its aiohttp service (node), the MLX thread's loop (engine) and batch (batch), sampling
and grammar, the prefix cache, the KV fidelity canary's decode side, the Mac's memory (budget, mac_memory) and
speculative decoding (speculative/). May import backends' root, kv_bridge and kv_bridge.mlx; never prefill/, cli/,
site/ or grading/. Importing the package imports no MLX: its modules do."""
