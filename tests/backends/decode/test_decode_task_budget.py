"""The MLX thread runs a task (the fidelity canary) ahead of each batch step for up to its budget (issue #50): with
a budget, all of a short task's steps run before the busy batch's next step, however long that step is; with none,
one step per batch step (as before). Real MLX on a tiny llama, in process; steps counted, never timed."""

from __future__ import annotations

import queue

from backends.decode.engine import Job, MLXModel
from kv_bridge.protocol import Sampling
from tests.support import tiny_models


def test_a_task_runs_ahead_of_the_batch_within_its_budget(tmp_path, empty_config):
    m = MLXModel("tiny", str(tiny_models.build("llama", tmp_path / "tiny")))
    m.load()
    m.start()
    events, tokens = queue.Queue(), []

    def emit(ev):  # the MLX thread: the same one that steps the task, so the count is exact
        if ev is not None and ev[0] == "token":
            tokens.append(ev)
        events.put(ev)

    def work(seen: list):
        for _ in range(5):
            seen.append(len(tokens))  # tokens the batch had produced when this step ran
            yield
        return seen

    never_ends = {str(t): -100.0 for t in m.tokenizer.eos_token_ids}  # busy for as long as the test needs
    busy = Job(tokens=[5, 6, 7], gen=Sampling.from_json({"max_tokens": 2000, "temperature": 0,
                                                         "logit_bias": never_ends}), emit=emit)
    try:
        m.submit(busy)
        assert events.get(timeout=60)[0] == "token"  # the batch is generating
        m.task_budget_s = 600.0
        ahead = m.run_task(lambda: work([])).result(60)
        assert len(set(ahead)) == 1, ahead  # every step before the batch's next one
        m.task_budget_s = 0.0
        interleaved = m.run_task(lambda: work([])).result(60)
        assert len(set(interleaved)) == 5 and interleaved == sorted(interleaved), interleaved
    finally:
        busy.cancel.set()
        m.stop()
