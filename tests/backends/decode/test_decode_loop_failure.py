"""When the decode node's MLX loop itself dies (not one request: a failed step only fails its batch), no request is
left waiting: the ones in the batch and in the queue get the error, later ones are refused at once, and /health
answers 503 so the gateway marks the node down and fails over. Real MLX on a tiny llama, in process."""

from __future__ import annotations

import queue
import threading

import pytest

from tests.support import tiny_models
from backends.decode import batch as decode_batch
from backends.common import NodeError
from backends.decode.engine import Job, MLXModel
from backends.decode.node import DecodeService
from kv_bridge.config.settings import Settings
from kv_bridge.protocol import Sampling
from tests.support.stack import free_port


def job(events: queue.Queue, tokens=(1, 2, 3), max_tokens: int = 50) -> Job:
    return Job(tokens=list(tokens), gen=Sampling.from_json({"max_tokens": max_tokens, "temperature": 0}),
               emit=events.put)


def drain(events: queue.Queue, timeout: float = 60) -> list:
    """Events up to and including the final None."""
    out = []
    while (ev := events.get(timeout=timeout)) is not None:
        out.append(ev)
    return out


def service(model_dir) -> DecodeService:
    settings = Settings(gateway={"host": "127.0.0.1", "port": free_port()}, prefill={}, decode={}, kv={},
                        nodes=[{"name": "decode-0", "role": "decode", "host": "127.0.0.1", "port": free_port(),
                                "kv_port": free_port()}],
                        models=[{"id": "tiny", "path": str(model_dir), "prefill": [], "decode": ["decode-0"]}])
    return DecodeService(settings, settings.node("decode-0"))


def test_a_dead_mlx_loop_fails_every_request_and_turns_health_to_503(tmp_path, empty_config, monkeypatch):
    svc = service(tiny_models.build("llama", tmp_path / "tiny"))
    m: MLXModel = svc.models["tiny"]
    m.load()
    assert svc.health()["batch_size"] == 0
    running, die = threading.Event(), threading.Event()
    step = decode_batch.Batch.step

    def step_then_die(self):
        step(self)
        running.set()
        if die.is_set():
            raise RuntimeError("simulated loop fault")

    monkeypatch.setattr(decode_batch.Batch, "step", step_then_die)
    m.start()
    try:
        in_batch = queue.Queue()
        m.submit(job(in_batch, max_tokens=10_000))
        assert running.wait(60)
        die.set()
        events = drain(in_batch)
        assert events[-1][0] == "error" and "simulated loop fault" in events[-1][1]
        assert m.failure is not None and "simulated loop fault" in m.failure

        later = queue.Queue()
        m.submit(job(later))  # after the loop died: refused at once, never left waiting
        assert drain(later, timeout=5) == [("error", m.failure)]

        with pytest.raises(NodeError) as e:
            svc.health()
        assert e.value.status == 503 and e.value.code == "engine_dead"
    finally:
        m.stop()


def test_a_task_cancelled_mid_work_leaves_the_loop_serving(tmp_path, empty_config):
    """A task on the decode node's MLX thread (the fidelity canary's comparison) whose caller went away: its future is
    cancelled (asyncio.wrap_future does that when the awaiting handler is cancelled, e.g. a gateway stopped mid-canary).
    The loop drops it and keeps serving; it used to settle the cancelled future, raise InvalidStateError and die, every
    model on the node answering 503 after (seen on `make site` when issue 33's narrow gateway stopped). Real MLX on a
    tiny llama, in process."""
    svc = service(tiny_models.build("llama", tmp_path / "tiny"))
    m = svc.models["tiny"]
    m.load()
    m.start()
    try:
        started, release = threading.Event(), threading.Event()

        def work():
            started.set()
            while not release.is_set():
                yield
            return "nobody reads this"

        future = m.run_task(work)
        assert started.wait(60)
        assert future.cancel()  # what wrap_future does when the awaiting handler is cancelled
        release.set()
        events = queue.Queue()
        m.submit(job(events, max_tokens=4))
        out = drain(events)
        assert out and all(ev[0] != "error" for ev in out), out
        assert m.failure is None
        assert svc.health()["batch_size"] == 0
    finally:
        m.stop()
