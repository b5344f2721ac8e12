"""A task on the decode node's MLX thread (the fidelity canary's comparison) whose caller went away: its future is
cancelled (asyncio.wrap_future does that when the awaiting handler is cancelled, e.g. a gateway stopped mid-canary).
The loop drops it and keeps serving; it used to settle the cancelled future, raise InvalidStateError and die, every
model on the node answering 503 after (seen on `make site` when issue 33's narrow gateway stopped). Real MLX on a
tiny llama, in process."""

from __future__ import annotations

import queue
import threading

import tiny_models
from test_decode_loop_failure import drain, job, service


def test_a_task_cancelled_mid_work_leaves_the_loop_serving(tmp_path, empty_config):
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
