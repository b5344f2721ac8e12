"""KV of an honest mixed-precision pair for the fidelity tests, made once: a tiny llama and mlx-lm's own 4-bit conversion
of it (`llama_q4`, a session fixture), MLX's own KV of a prompt ((L, H, T, D) as a transfer carries it) and that KV as
the receiver hands the decode node (`received`); `drive` runs an MLX-thread generator to its end."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kv_bridge.assembly import ReceivedKV
from tests.support import tiny_models


@pytest.fixture(scope="session")
def llama_q4(tmp_path_factory) -> SimpleNamespace:
    """full, q4: the tiny llama and its 4-bit conversion (mlx-lm models); rope: the full one's RoPE shift
    (kv_bridge/mlx/fidelity.rope_shift); path: the full one's folder."""
    from mlx_lm import load

    from backends.cli.checkpoints import convert
    from kv_bridge.mlx.fidelity import rope_shift

    work = tmp_path_factory.mktemp("llama-q4")
    src = tiny_models.build("llama", work / "m")
    full, _ = load(str(src))
    q4, _ = load(str(convert(src, work / "q4", 4)))
    return SimpleNamespace(full=full, q4=q4, rope=rope_shift(full), path=src)


def drive(gen):
    """Run an MLX-thread generator (one step per next) to its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def own_kv(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """MLX's own prefill of `ids`: (L, H, T, D) float32 keys and values, as a transfer would carry them."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kv_bridge.mlx.cache import cache_kv

    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    return cache_kv(cache, len(ids))


def received(keys: np.ndarray, values: np.ndarray, start: int = 0, wire: str = "float32", chunk: int = 64,
             first: np.ndarray | None = None) -> ReceivedKV:
    """(L, H, T, D) KV of positions [start, start + T) as the receiver hands it: through `wire` (fp8 scaled per
    `chunk` positions, as prefill steps send it), each layer's first position `first` (default `start`)."""
    from kv_bridge.mlx.fidelity_metric import wire_encode

    k, v = (np.ascontiguousarray(np.stack([wire_encode(x[i], wire, chunk) for i in range(x.shape[0])]))
            for x in (keys, values))
    return ReceivedKV(start, k, v, k.nbytes, 0.1, dtype="float32", wire_dtype=wire,
                      layer_first=np.full(k.shape[0], start) if first is None else first)
