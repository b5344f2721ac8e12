"""The decode node's real-traffic KV check (kv_bridge/mlx/traffic.py): every transfer's layer 0 against MLX's own,
on the model's MLX thread, before a token is decoded on it; a failure sends the request down the local fallback."""

from __future__ import annotations

from kv_bridge.mlx import traffic


def traffic_check(m, ids: list[int], kv):
    """MLX thread, a generator (MLXModel.run_task): {"ok", "finding", "message", "tokens", "seconds"} for the
    received `kv` of prompt `ids` on model `m` (its weights choose the allowance, as the canary's do)."""
    from kv_bridge.mlx.fidelity import weights_of

    out = yield from traffic.check(m.model, ids, kv, kv.wire_dtype, weights_of(m.path))
    return {**out, "message": "" if out["ok"] else traffic.describe(out["finding"])}
