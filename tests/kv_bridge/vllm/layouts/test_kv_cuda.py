"""The extractor on a real GPU, in the ways it can fail there: stream ordering against the forward pass, the block
reuse race once vLLM frees a request's blocks, host blocking (torch's and vLLM 0.32's sync checks), fp8 caches typed
uint8 and float8, the bf16 -> fp8 wire, kernel blocks smaller than cache blocks, block-outermost cache layouts, the
writer thread's wait. The CUDA cases are skipped without an NVIDIA GPU; none has run on this project's CPU-only
machines. Tests parametrized over the device run their `cpu` case everywhere, against the same independent reference.
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch

from kv_bridge import dtypes
from kv_bridge.vllm.extract import Extractor, Span
from kv_bridge.vllm.layers import layer_layouts
from kv_bridge.vllm.layouts import layout_for

pytestmark = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]  # the same test body and reference on both
H, D, BS, NB = 4, 128, 16, 64
CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s or more of GPU time, far longer than any extraction


def dense_cache(dtype=torch.bfloat16, order: str = "LBHNC", layers: int = 1, layer: int = 0,
                device: str = "cuda", block: int = BS) -> torch.Tensor:
    """A per-layer logical view [NB, H, block, 2D] of a cache stored in `order` (block-outermost: all layers'
    pages of one block together, the view strided over them), as vLLM hands it to the connector."""
    dims = {"L": layers, "B": NB, "H": H, "N": block, "C": 2 * D}
    phys = torch.randn([dims[c] for c in order], device=device).to(dtype)
    view = phys.select(order.index("L"), layer)
    rest = order.replace("L", "")
    return view.permute(*(rest.index(c) for c in "BHNC"))


def host_kv(part) -> tuple[np.ndarray, np.ndarray]:
    part.ready()
    return part.keys.copy(), part.values.copy()


def want(cache: torch.Tensor, layout, blocks: list[int], start: int, end: int):
    k, v = layout.gather(cache.float().cpu().numpy(), blocks, start, end)
    return k, v


def extractor(dtype=torch.bfloat16, wire="bfloat16", fp8=False, device="cuda"):
    return Extractor(layout_for("FLASH_ATTN", BS, H, D, "LBHNC"), wire, fp8, torch.device(device))


def at(cache: torch.Tensor, addr: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Reference K, V (H, n, D) float32 of the tokens at (block, offset) `addr`, read straight off the logical
    view [blocks, H, block, K then V] (the dense CUDA layout as vLLM documents it; no adapter code)."""
    c = cache.float().cpu().numpy()
    rows = np.stack([c[b, :, o] for b, o in addr], axis=1)  # (H, n, 2D)
    return rows[..., :D], rows[..., D:]


@needs_gpu
def test_extract_sees_kv_written_by_the_busy_main_stream():
    """The main stream is busy, then writes new K/V: the extraction queued after it must see the new values."""
    cache, ex = dense_cache(), extractor()
    blocks = list(range(10, 20))
    torch.cuda._sleep(CYCLES)
    cache[10:20] = 3.0  # queued on the main stream behind the sleep
    k, _ = host_kv(ex.extract_batch(cache, [Span(blocks, 0, 160)], (1.0, 1.0)).parts[0])
    assert np.all(k.view(np.uint16) == np.array([3.0], dtype=np.float32).view(np.uint32)[0] >> 16)


@needs_gpu
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


@needs_gpu
def test_extract_does_not_block_the_host():
    """extract_batch only queues GPU work: it returns while the main stream is still busy (no sync with it)."""
    cache, ex = dense_cache(), extractor()
    torch.cuda._sleep(CYCLES * 5)
    ex.extract_batch(cache, [Span(list(range(8)), 0, 100), Span(list(range(8, 16)), 3, 120)], (1.0, 1.0))
    assert not torch.cuda.current_stream().query(), "extract_batch waited for the forward pass"
    torch.cuda.synchronize()


@needs_gpu
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


@needs_gpu
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


@needs_gpu
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


@needs_gpu
@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_every_stride_order_including_block_outermost(order):
    cache = dense_cache(torch.float16, order, layers=3, layer=1)
    ex = extractor(torch.float16, "float16")
    spans = [Span([5, 0, 33], 2, 40), Span([60, 61], 0, 17)]
    for s, part in zip(spans, ex.extract_batch(cache, spans, (1.0, 1.0)).parts):
        k, v = host_kv(part)
        rk, rv = want(cache, ex.layout, s.block_ids, s.start, s.end)
        assert np.array_equal(k.astype(np.float32), rk) and np.array_equal(v.astype(np.float32), rv)


@needs_gpu
def test_pinned_buffers_are_reused_once_released():
    cache, ex = dense_cache(), extractor()
    first = ex.extract_batch(cache, [Span(list(range(4)), 0, 64)], (1.0, 1.0))
    first.parts[0].ready()
    first.release()
    second = ex.extract_batch(cache, [Span(list(range(4)), 0, 64)], (1.0, 1.0))
    assert second.parts[0].keys.ctypes.data == first.parts[0].keys.ctypes.data


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_cache_on_the_fp8_wire_has_the_numpy_encoders_bytes_and_scales(device):
    """kv.wire_dtype float8_e4m3 over a bf16 cache, three requests in one step: each span's bytes are those of the
    numpy reference encoder (dtypes.e4m3_encode) at the scale that was sent (the one a receiver decodes with), except
    at exact ties (torch rounds those to even); and that scale is the span's own amax / 448 exactly, K's and V's
    apart (a zero span: the 1e-12 floor, not NaN). On CUDA an amax divided by a Python scalar came out one ulp high."""
    torch.manual_seed(1)
    cache = dense_cache(torch.float32, device=device)
    cache[..., D:] *= 0.25  # V's scale differs from K's: a K/V scale swap shows
    cache[60:62] *= 40  # the third request's scale differs from the others': a batch-wide scale shows
    cache[12] = 0
    cache = cache.to(torch.bfloat16)
    spans = [Span([5, 0, 33], 2, 40), Span([12], 3, 9), Span([60, 61, 7], 10, 47)]
    batch = extractor(wire="float8_e4m3", device=device).extract_batch(cache, spans, (1.0, 1.0))
    for s, part in zip(spans, batch.parts):
        part.ready()
        refs = at(cache, [(s.block_ids[t // BS], t % BS) for t in range(s.start, s.end)])
        for got, ref, scale in zip((part.keys, part.values), refs, part.scales):
            sent = np.float32(scale)
            want = dtypes.e4m3_encode(ref, sent)
            assert got.dtype == np.uint8 and got.shape == want.shape
            y, table = ref / sent, dtypes.E4M3_TABLE
            off = got != want
            tie = np.abs(table[got] - y) == np.abs(table[want] - y)
            assert np.all(tie[off]), f"{off.sum()} codes differ from e4m3_encode at the sent scale, not at ties: {s}"
            assert off.mean() < 1e-3
            want_scale = max(np.float32(np.abs(ref).max()) / np.float32(448), np.float32(1e-12))
            assert sent == want_scale, (s, float(sent), float(want_scale), "not amax / 448 exactly")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["LBHNC", "BLNHC"])
def test_kernel_blocks_smaller_than_cache_blocks(device, order):
    """vLLM splits each 64-token cache block into four 16-token kernel blocks (cache block b = kernel blocks
    4b..4b+3) and registers the kernel-block view: spans in the scheduler's cache blocks, mapped as save_kv_layer
    maps them, read each token at its kernel-block address, across kernel and cache block boundaries."""
    cache_block, kernel = 64, 16
    cache = dense_cache(order=order, layers=2, layer=1, device=device, block=kernel)
    ll = layer_layouts({"l1": cache}, {"l1": "FLASH_ATTN"}, order, cache_block, H, D)["l1"]
    assert (ll.ratio, ll.layout.block_size) == (4, kernel)
    ex = Extractor(ll.layout, "bfloat16", False, torch.device(device))
    reqs = [([9, 2, 14], 5, 150), ([0, 7], 63, 100), ([3], 17, 18)]
    spans = [Span(ll.kernel_blocks(ids), a, e) for ids, a, e in reqs]
    batch = ex.extract_batch(cache, spans, (1.0, 1.0), ll.layout)
    for (ids, a, e), part in zip(reqs, batch.parts):
        part.ready()
        addr = [(ids[t // cache_block] * 4 + t % cache_block // kernel, t % kernel) for t in range(a, e)]
        ref_k, ref_v = at(cache, addr)
        assert np.array_equal(dtypes.to_float32(part.keys, "bfloat16"), ref_k), (ids, a, e)
        assert np.array_equal(dtypes.to_float32(part.values, "bfloat16"), ref_v), (ids, a, e)


@needs_gpu
def test_writer_thread_waits_for_the_copy_not_its_own_stream():
    """The engine computes on a non-default stream, busy, then writes the step's KV; the copy queues behind it.
    The writer thread (its current stream is the idle default one) starts while the copy has not landed, and
    after `ready()` must read exactly the step's values. Fails on one GPU if ready() waits on the writer's own or
    the default stream, or polls, or if the copy stream waited on the default stream instead of the engine's."""
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        cache, ex = torch.zeros(NB, H, BS, 2 * D, device="cuda", dtype=torch.bfloat16), extractor()
        fresh = torch.randn(4, H, BS, 2 * D, device="cuda").to(torch.bfloat16)
        torch.cuda._sleep(CYCLES * 5)
        cache[10:14] = fresh  # this step's KV, queued behind the sleep on the engine's stream
        part = ex.extract_batch(cache, [Span(list(range(10, 14)), 0, 64)], (1.0, 1.0)).parts[0]
    assert not compute.query(), "the engine's stream finished before the writer started: the test proves nothing"
    seen = {}

    def writer():
        seen["early"] = part.keys.copy()
        torch.cuda.current_stream().synchronize()  # the wrong wait: this thread's stream, idle
        seen["wrong_wait"] = part.keys.copy()
        part.ready()
        seen["keys"], seen["copy_done"] = part.keys.copy(), ex.stream.query()

    t = threading.Thread(target=writer)
    t.start()
    t.join()
    want = at(cache, [(10 + i // BS, i % BS) for i in range(64)])[0]  # synchronizes: the step is done
    assert not np.array_equal(dtypes.to_float32(seen["early"], "bfloat16"), want), "copy landed before the writer"
    assert not np.array_equal(dtypes.to_float32(seen["wrong_wait"], "bfloat16"), want), \
        "a wait on the writer's own stream already sees the copy: the test cannot tell a wrong wait"
    assert np.array_equal(dtypes.to_float32(seen["keys"], "bfloat16"), want)
    assert seen["copy_done"]


def _extract_every_wire(device: str = "cuda") -> None:
    """One step's extraction per wire: bf16 as stored, bf16 -> fp8 wire, an fp8 cache with its scales."""
    spans = [Span(list(range(8)), 0, 100), Span([9, 10], 3, 20)]
    extractor(device=device).extract_batch(dense_cache(device=device), spans, (1.0, 1.0))
    extractor(wire="float8_e4m3", device=device).extract_batch(dense_cache(device=device), spans, (1.0, 1.0))
    fp8 = dense_cache(device=device).to(torch.float8_e4m3fn).view(torch.uint8)
    extractor(torch.uint8, "float8_e4m3", fp8=True, device=device).extract_batch(fp8, spans, (0.5, 0.25))


@needs_gpu
def test_extraction_makes_no_call_torchs_sync_debug_mode_flags():
    """torch.cuda.set_sync_debug_mode("error") (what vLLM's VLLM_GPU_SYNC_CHECK arms) around every wire's
    extraction: an .item(), a blocking copy or a stream sync in the path raises. The control shows it is armed."""
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.ones(1, device="cuda").item()
        _extract_every_wire()
    finally:
        torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize()


@needs_gpu
def test_extraction_passes_vllms_gpu_sync_check():
    """vLLM 0.32's own check (VLLM_GPU_SYNC_CHECK, set by `make test-gpu`; vllm/utils/gpu_sync_debug.py), which
    polices save_kv_layer inside execute_model in an engine run: torch's sync debug mode plus its wrappers that
    flag non_blocking copies through pageable or gapped host memory (silently synchronous). Last in this file:
    it patches Tensor.to/copy_ for the rest of the process (they report only inside a checked call)."""
    sync = pytest.importorskip("vllm.utils.gpu_sync_debug", reason="vLLM not installed (the prefill image has it)")
    if sync._SYNC_CHECK_MODE is None:
        pytest.skip("VLLM_GPU_SYNC_CHECK unset when vLLM was imported (`make test-gpu` sets it)")
    sync.enable_gpu_sync_check()

    def flagged(fn) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                sync.with_gpu_sync_check(fn)()
            except RuntimeError as e:  # VLLM_GPU_SYNC_CHECK=error raises instead of warning
                return [str(e)]
        return [str(w.message) for w in seen if "synchron" in str(w.message).lower()]

    pageable = torch.ones(1 << 16)
    assert flagged(lambda: torch.ones(1, device="cuda").item()), "vLLM's check did not flag an .item()"
    assert flagged(lambda: pageable.to("cuda", non_blocking=True)), "vLLM's check did not flag a pageable copy"
    assert flagged(_extract_every_wire) == []
