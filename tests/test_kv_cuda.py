"""The extractor on a real GPU, in the ways it can fail there: stream ordering against the forward pass, the block
reuse race once vLLM frees a request's blocks, host blocking, fp8 caches typed uint8 and float8, block-outermost
cache layouts. Skipped without an NVIDIA GPU; none of these has run on this project's CPU-only machines.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kv_bridge.vllm.extract import Extractor, Span
from kv_bridge.vllm.layouts import layout_for

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
H, D, BS, NB = 4, 128, 16, 64
CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s or more of GPU time, far longer than any extraction


def dense_cache(dtype=torch.bfloat16, order: str = "LBHNC", layers: int = 1, layer: int = 0) -> torch.Tensor:
    """A per-layer logical view [NB, H, BS, 2D] of a cache stored in `order` (block-outermost: all layers'
    pages of one block together, the view strided over them), as vLLM hands it to the connector."""
    dims = {"L": layers, "B": NB, "H": H, "N": BS, "C": 2 * D}
    phys = torch.randn([dims[c] for c in order], device="cuda").to(dtype)
    view = phys.select(order.index("L"), layer)
    rest = order.replace("L", "")
    return view.permute(*(rest.index(c) for c in "BHNC"))


def host_kv(part) -> tuple[np.ndarray, np.ndarray]:
    part.ready()
    return part.keys.copy(), part.values.copy()


def want(cache: torch.Tensor, layout, blocks: list[int], start: int, end: int):
    k, v = layout.gather(cache.float().cpu().numpy(), blocks, start, end)
    return k, v


def extractor(dtype=torch.bfloat16, wire="bfloat16", fp8=False):
    return Extractor(layout_for("FLASH_ATTN", BS, H, D, "LBHNC"), wire, fp8, torch.device("cuda"))


def test_extract_sees_kv_written_by_the_busy_main_stream():
    """The main stream is busy, then writes new K/V: the extraction queued after it must see the new values."""
    cache, ex = dense_cache(), extractor()
    blocks = list(range(10, 20))
    torch.cuda._sleep(CYCLES)
    cache[10:20] = 3.0  # queued on the main stream behind the sleep
    k, _ = host_kv(ex.extract_batch(cache, [Span(blocks, 0, 160)], (1.0, 1.0)).parts[0])
    assert np.all(k.view(np.uint16) == np.array([3.0], dtype=np.float32).view(np.uint32)[0] >> 16)


def test_blocks_reused_right_after_extract_still_deliver_the_old_values():
    """vLLM frees the blocks at request_finished and the next step overwrites them while our copy stream is still
    behind: the values read must be those of the step that computed them."""
    cache, ex = dense_cache(torch.float32, order="LBHNC"), extractor(torch.float32, "float32")
    blocks = [3, 9, 4]
    ref = want(cache, ex.layout, blocks, 5, 40)
    with torch.cuda.stream(ex.stream):
        torch.cuda._sleep(CYCLES)  # the side stream lags far behind
    batch = ex.extract_batch(cache, [Span(blocks, 5, 40)], (1.0, 1.0))
    cache[blocks] = -1.0  # the next step reuses the blocks at once, on the main stream
    k, v = host_kv(batch.parts[0])
    assert np.array_equal(k, ref[0]) and np.array_equal(v, ref[1])


def test_extract_does_not_block_the_host():
    """extract_batch only queues GPU work: it returns while the main stream is still busy (no sync with it)."""
    cache, ex = dense_cache(), extractor()
    torch.cuda._sleep(CYCLES * 5)
    ex.extract_batch(cache, [Span(list(range(8)), 0, 100), Span(list(range(8, 16)), 3, 120)], (1.0, 1.0))
    assert not torch.cuda.current_stream().query(), "extract_batch waited for the forward pass"
    torch.cuda.synchronize()


@pytest.mark.parametrize("stored", [torch.uint8, torch.float8_e4m3fn])
def test_fp8_cache_extract_does_not_block_the_host(stored):
    """An fp8 cache's scales reach the device without a blocking copy: extract_batch returns (for every layer of a
    step) while the main stream is still busy."""
    base = torch.randn(NB, H, BS, 2 * D, device="cuda").to(torch.float8_e4m3fn)
    cache = base.view(torch.uint8) if stored is torch.uint8 else base
    ex = extractor(stored, "float8_e4m3", fp8=True)
    torch.cuda._sleep(CYCLES * 5)
    for layer in range(4):  # each layer its own scales, the same spans
        ex.extract_batch(cache, [Span(list(range(8)), 0, 100), Span([9, 10], 3, 20)], (0.5 + layer, 0.25))
    assert not torch.cuda.current_stream().query(), "extract_batch waited for the forward pass (fp8 scales)"
    torch.cuda.synchronize()


def test_writer_waits_on_the_copys_device_without_spinning():
    """The writer thread's wait runs with the extractor's device current (a fresh thread starts on device 0) and
    sleeps: its CPU time over a long wait is a small part of the wall time (a spinning wait burns all of it)."""
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    with torch.cuda.device(dev):
        cache = torch.randn(NB, H, BS, 2 * D, device=dev).to(torch.bfloat16)
        ex = Extractor(layout_for("FLASH_ATTN", BS, H, D, "LBHNC"), "bfloat16", False, dev)
        torch.cuda._sleep(CYCLES * 5)
        part = ex.extract_batch(cache, [Span(list(range(4)), 0, 64)], (1.0, 1.0)).parts[0]
    seen = {}

    def writer():
        wall, cpu = time.perf_counter(), time.thread_time()
        part.ready()
        seen["device"] = torch.cuda.current_device()
        seen["cpu_share"] = (time.thread_time() - cpu) / (time.perf_counter() - wall)

    t = threading.Thread(target=writer)
    t.start()
    t.join()
    assert seen["device"] == dev.index
    assert seen["cpu_share"] < 0.5, f"the wait spun a core ({seen['cpu_share']:.0%} of its wall time on CPU)"


@pytest.mark.parametrize("stored", [torch.uint8, torch.float8_e4m3fn])
def test_fp8_cache_travels_as_its_bytes_with_the_layers_current_scales(stored):
    base = torch.randn(NB, H, BS, 2 * D, device="cuda").to(torch.float8_e4m3fn)
    cache = base.view(torch.uint8) if stored is torch.uint8 else base
    ex = extractor(stored, "float8_e4m3", fp8=True)
    part = ex.extract_batch(cache, [Span([7, 2], 4, 30)], (0.5, 0.25)).parts[0]
    k, v = host_kv(part)
    ref_k, ref_v = ex.layout.gather(base.view(torch.uint8).cpu().numpy(), [7, 2], 4, 30)
    assert np.array_equal(k, ref_k) and np.array_equal(v, ref_v)
    assert list(part.scales) == [0.5, 0.25]


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_every_stride_order_including_block_outermost(order):
    cache = dense_cache(torch.float16, order, layers=3, layer=1)
    ex = extractor(torch.float16, "float16")
    spans = [Span([5, 0, 33], 2, 40), Span([60, 61], 0, 17)]
    for s, part in zip(spans, ex.extract_batch(cache, spans, (1.0, 1.0)).parts):
        k, v = host_kv(part)
        rk, rv = want(cache, ex.layout, s.block_ids, s.start, s.end)
        assert np.array_equal(k.astype(np.float32), rk) and np.array_equal(v.astype(np.float32), rv)


def test_pinned_buffers_are_reused_once_released():
    cache, ex = dense_cache(), extractor()
    first = ex.extract_batch(cache, [Span(list(range(4)), 0, 64)], (1.0, 1.0))
    first.parts[0].ready()
    first.release()
    second = ex.extract_batch(cache, [Span(list(range(4)), 0, 64)], (1.0, 1.0))
    assert second.parts[0].keys.ctypes.data == first.parts[0].keys.ctypes.data
