"""The MLX side of a decode node: one thread per model owns it and runs mlx-lm's BatchGenerator (continuous
batching, driven as mlx_lm.server drives it), or stream_generate one request at a time for quantized caches.
Every token goes back through its Job's `emit`; nothing here touches the event loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from backends.decode.batch import Batch, LeadingSpace, token_line
from backends.decode.sampling import make_sampling
from kv_bridge.fingerprint import config_kv_dtype, kv_spec
from kv_bridge.protocol import Sampling

log = logging.getLogger("backends.decode.node")


@dataclass(eq=False)
class Job:
    """One generation for the MLX thread.

    `tokens`: the tokens still to run (at least the prompt's last). `make_cache`: builds the request's initial
    per-layer cache on the MLX thread (received KV, later a prefix cache with it appended); it holds `history`,
    the tokens before `tokens`. None: a fresh cache, the whole prompt is in `tokens`. `emit` gets
    ("token", TokenLine, finish_reason) per token or ("error", message), then None once the job has left the loop and
    its cache is freed. `on_finished(tokens, cache)` (MLX thread, must not block) gets the final per-request cache
    and the tokens it holds (history + prompt + every token delivered: BatchGenerator delivers a token once it
    has run it), for a finished or cancelled batched request. `grammar`: the request's GrammarProcessor (JSON mode,
    a JSON schema), or None.
    """

    tokens: list[int]
    gen: Sampling
    emit: Callable
    make_cache: Callable[[], list] | None = None
    history: list[int] = field(default_factory=list)
    on_finished: Callable[[list[int], list], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    grammar: object | None = None
    draft_kv: tuple | None = None  # (start, keys, values): a drafter's own prompt KV from the prefill node


@dataclass(eq=False)
class Task:
    """Other work for the MLX thread (the fidelity canary): `work()` returns a generator the loop advances ahead of
    each batch step, for up to MLXModel.task_budget_s (at least one step), so a busy batch cannot starve it and a
    long piece of work never stalls the batch; its return value settles `future`. `started`: when its first step ran
    (time.monotonic; None while it waits in the inbox): its wait is not its run time."""

    work: Callable[[], object]
    future: Future = field(default_factory=Future)
    steps: object | None = None
    started: float | None = None

    def settle(self, result: object = None, error: BaseException | None = None) -> None:
        """The task's outcome to its caller, unless the caller went (cancelled: a gateway stopped mid-canary)."""
        if self.future.cancelled():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


class MLXModel:
    """The model, its tokenizer and the one thread that may touch them."""

    def __init__(self, model_id: str, path: str, kv_bits: int | None = None, kv_group_size: int = 64,
                 max_batch_size: int = 32, prefix_cache_bytes: int = 0, speculative=None):
        from backends.decode.prefix_cache import PrefixStore
        from backends.decode.speculative.control import SpecController
        from backends.decode.speculative.sources import check_names
        from kv_bridge.config.speculative import SpeculativeConfig

        self.model_id, self.path = model_id, path
        self.kv_bits, self.kv_group_size, self.max_batch_size = kv_bits, kv_group_size, max_batch_size
        self.prefixes = PrefixStore(prefix_cache_bytes)  # finished generations' caches, for the next turn
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"mlx-{model_id}")
        self.model = self.tokenizer = self.grammars = self.draft_model = None
        self.suffix_store = None  # speculative "suffix": this model's earlier answers (sources.py makes it on first use)
        self.speculation = SpecController(speculative or SpeculativeConfig())  # speculative decoding (docs/speculative.md)
        check_names(tuple(n for n in self.speculation.cfg.sources if n != "auto"))  # a name no source has: refused
        self.draft_cap: int | None = None  # after load: the most drafted tokens attention stays fused for
        self.spec = kv_spec(path)
        self.dtype = self.kv_dtype = None  # after load: the KV dtype (mx.Dtype) and its name (kv_bridge.dtypes)
        self._inbox: queue.SimpleQueue[Job | Task | None] = queue.SimpleQueue()
        self._tasks: list[Task] = []  # MLX thread only
        self.failure: str | None = None  # set when the MLX loop itself died: the node can serve nothing more
        self.batch_size = self.cache_bytes = 0  # published by the MLX thread after every step, read by /health
        # Seconds of task work (the canary's steps) run ahead of each batch step: a canary of a few one-forward steps
        # finishes within one batch step of arriving, however long the batch's prefill chunks are.
        self.task_budget_s = 2.0

    def load(self) -> None:
        import mlx.core as mx
        from mlx_lm import load

        from backends.decode.speculative.sources import load_models

        self.model, self.tokenizer = load(self.path)
        _harmony_stops(self.tokenizer)
        self.dtype = _kv_dtype(self.model)
        self.kv_dtype = str(self.dtype).removeprefix("mlx.core.")  # received KV is reserved and held in it
        predicted = config_kv_dtype(self.path)
        if predicted != self.kv_dtype:  # `disagg config check` budgets from config.json's dtype
            log.warning("%s: MLX computes KV in %s but config.json says %s: `disagg config check` counts its KV at "
                        "the wrong size", self.model_id, self.kv_dtype, predicted)
        # The logits width: what logit_bias ids and top_k are checked against.
        self.vocab_size = getattr(getattr(self.model, "args", None), "vocab_size", None) or len(self.tokenizer.vocab)
        mx.eval(self.model.parameters())
        self.grammars = _grammar_compiler(self.tokenizer, self.vocab_size)
        load_models(self)  # the draft model or learned drafter a configured source needs, the cap on k
        if self.kv_bits is not None:  # refuse at start-up what quantization cannot do for this model
            from mlx_lm.models.cache import make_prompt_cache

            from kv_bridge.mlx.cache import quantize

            quantize(make_prompt_cache(self.model), self.kv_bits, self.kv_group_size)

    def grammar_for(self, gen: Sampling, ids: list[int]):
        """The request's GrammarProcessor (None without a grammar); a resumed generation's last
        `gen.grammar_generated` prompt tokens are fed to it first. Any thread. Raises GrammarError (a 400)."""
        from backends.decode.grammar import GrammarError, GrammarSpec

        if gen.grammar is None:
            return None
        if self.grammars is None:
            raise GrammarError("this decode node cannot constrain output: install llguidance on it")
        if gen.grammar_generated >= len(ids):
            raise GrammarError("grammar_generated must be less than the number of prompt tokens")
        generated = ids[len(ids) - gen.grammar_generated:] if gen.grammar_generated else []
        return self.grammars.processor(GrammarSpec.from_wire(gen.grammar), generated)

    def start(self) -> None:
        """Start the MLX loop on the model's thread (after load)."""
        self.executor.submit(self._run)

    def stop(self) -> None:
        self._inbox.put(None)
        self.executor.shutdown(wait=False, cancel_futures=True)

    def queued(self) -> int:
        """Jobs submitted and not yet taken into the loop (any thread; /metrics)."""
        return self._inbox.qsize()

    def submit(self, job: Job) -> None:
        """Any thread: queue a job; the loop admits it at its next step (or fails it, once the loop is dead)."""
        self._inbox.put(job)
        if self.failure is not None:  # the loop may have drained its inbox before this job arrived
            self._fail_queued()

    def run_task(self, work: Callable[[], object]) -> Future:
        """Any thread: run `work()`'s generator on the MLX thread ahead of batch steps; the future gets its result
        (use submit_task for the Task itself: when it started)."""
        return self.submit_task(work).future

    def submit_task(self, work: Callable[[], object]) -> Task:
        """Any thread: queue `work()`'s generator for the MLX thread; the Task says when it started and settles."""
        task = Task(work)
        self.submit(task)
        return task

    def _fail_queued(self) -> None:
        """Every queued job gets the loop's failure and leaves (any thread; the inbox hands each job out once)."""
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, Task):
                job.settle(error=RuntimeError(self.failure))
            elif job is not None:
                job.emit(("error", self.failure))
                job.emit(None)

    def bridged_cache(self, kv) -> list:
        """MLX thread: the per-layer cache holding received KV, quantized as mlx-lm does after its own prefill."""
        from kv_bridge.mlx.cache import build_prompt_cache, quantize

        cache = build_prompt_cache(self.model, kv.keys, kv.values, self.dtype)
        return quantize(cache, self.kv_bits, self.kv_group_size)

    def prompt_cache(self, prefix, kv) -> list:
        """MLX thread: the request's initial cache: a private copy of the held prefix, extended by the received KV
        (which starts where the prefix ends), or the received KV alone."""
        from backends.decode.prefix_cache import PrefixStore
        from kv_bridge.mlx.cache import append_kv

        try:
            if prefix is None:
                return self.bridged_cache(kv)
            cache = PrefixStore.take(prefix)
            if kv is not None:
                append_kv(cache, kv.keys, kv.values, self.dtype)
            return cache
        finally:
            if kv is not None:  # MLX copied the KV: the receive buffers can serve the next transfer
                kv.release()

    def keep(self, tokens: list[int], cache: list) -> None:
        """MLX thread (on_finished): offer a finished generation's cache to the prefix store for the next turn."""
        try:
            self.prefixes.store(self.model_id, tokens, cache)
        except ValueError:  # a cache that does not match what was fed is a bug, but never worth the answer
            log.exception("prefix store refused a finished generation's cache")

    def _run(self) -> None:
        """The MLX thread's loop: admit what arrived, step the batch, deliver, drop what finished or was cancelled."""
        batch = Batch(self) if self.kv_bits is None else None
        specs: list = []  # generations on the speculative path (backends/decode/speculative/step.py)
        try:
            while True:
                arrivals = self._arrivals(block=(batch is None or not batch.jobs) and not specs and not self._tasks)
                for job in arrivals:
                    if job is None:
                        return
                    if isinstance(job, Task):
                        self._tasks.append(job)
                    elif batch is None:
                        self._run_alone(job)
                    else:
                        specs = self._admit(batch, specs, job)
                self._advance_tasks()  # ahead of the batch: one batch step is all a task ever waits
                for run in specs:
                    run.alone = len(specs) == 1 and not (batch and batch.jobs)
                specs = [run for run in specs if run.step()]  # each stays on its path to its end unless joined
                if batch is not None:
                    self._step_batch(batch, specs)
                    self.batch_size = len(batch.jobs) + len(specs)
                    self.cache_bytes = batch.nbytes() + sum(run.nbytes for run in specs)
        except Exception as e:  # the loop itself broke (not one request): nothing can be served any more
            log.exception("MLX loop for %s died", self.model_id)
            self.failure = f"the MLX loop for {self.model_id} died: {type(e).__name__}: {e}"
            for run in specs:
                run.fail(self.failure)
            if batch is not None:
                batch.abandon(self.failure)
            for task in self._tasks:
                task.settle(error=RuntimeError(self.failure))
            self._fail_queued()  # no request waits forever: /health now answers 503, the gateway fails over

    def _step_batch(self, batch: Batch, specs: list) -> None:
        """One batch step; while it runs alone at a steady size its wall time is that size's measured step (what
        speculating per row is weighed against: SpecController.share)."""
        n = len(batch.jobs)
        t0 = time.perf_counter()
        delivered = batch.step()
        if n and not specs and delivered == n:  # a decode step of every generation (no arrival's prefill in it)
            self.speculation.meter.add_batch(n, time.perf_counter() - t0)

    def _admit(self, batch: Batch, specs: list, job: Job) -> list:
        """A new job: on the speculative path when speculation is on and it would be the model's only generation, or
        when the controller measures that speculating each row beats batching them (SpecController.share);
        otherwise into the batch, and the speculative ones running join it there (the batch decodes them all)."""
        stats = self.speculation.stats
        wants = self.speculation.enabled and job.gen.speculative
        if specs and not (wants and not batch.jobs and self.speculation.share(len(specs) + 1)):
            for run in specs:
                if run.settle():  # its pending token read and emitted first
                    batch.adopt(run)
                    stats.ran("joined_batch")
            specs = []
        if not wants:
            batch.add(job)
            if self.speculation.enabled:  # the request asked for plain decoding (kv_bridge.protocol)
                stats.ran("request_off")
            return specs
        if not batch.jobs and not job.cancel.is_set():  # alone, or beside others speculating (share said so)
            return specs + self._start_spec(batch, job)
        batch.add(job)
        stats.ran("batch")
        return specs

    def _start_spec(self, batch: Batch, job: Job) -> list:
        """[the job's SpecRun], or [] when it went to the batch (an untrimmable cache) or failed to start."""
        from backends.decode.speculative.step import SpecRun

        try:
            run = SpecRun(self, job)
            started = run.start()
        except Exception as e:  # the request's own failure (its KV, its sampling): an error line
            Batch._refuse(job, e)
            return []
        if started:
            self.speculation.stats.ran("speculative")
            return [run]
        batch.adopt(run)
        self.speculation.stats.ran("untrimmable_cache")
        return []

    def _advance_tasks(self) -> None:
        """Steps of each task, round robin, until they finish or `task_budget_s` is spent (each at least one step); a
        finished or failed one settles its future and leaves."""
        deadline = time.monotonic() + self.task_budget_s
        while self._tasks:
            for task in list(self._tasks):
                self._step_task(task)
            if time.monotonic() >= deadline:
                return

    def _step_task(self, task: Task) -> None:
        if task.future.cancelled():  # its caller went: stop the work
            self._tasks.remove(task)
            return
        try:
            if task.steps is None:
                task.started = time.monotonic()
                task.steps = task.work()
            next(task.steps)
        except StopIteration as done:
            self._tasks.remove(task)
            task.settle(done.value)
        except Exception as e:  # the task's own failure, never the loop's
            log.exception("MLX task failed")
            self._tasks.remove(task)
            task.settle(error=e)

    def _arrivals(self, block: bool) -> list[Job | Task | None]:
        jobs = [self._inbox.get()] if block else []
        while True:
            try:
                jobs.append(self._inbox.get_nowait())
            except queue.Empty:
                return jobs

    def _run_alone(self, job: Job) -> None:
        """One quantized-cache generation with stream_generate (mlx-lm cannot batch QuantizedKVCache)."""
        from mlx_lm import stream_generate
        from mlx_lm.models.cache import make_prompt_cache

        try:
            if job.cancel.is_set():
                return
            cache = job.make_cache() if job.make_cache else make_prompt_cache(self.model)
            self.batch_size, self.cache_bytes = 1, _nbytes(cache)
            sampler, processors = make_sampling(job.gen, job.history, self.vocab_size, job.grammar)
            lead = LeadingSpace(self.tokenizer)
            fed = [*job.history, *job.tokens]
            for r in stream_generate(self.model, self.tokenizer, job.tokens, max_tokens=job.gen.max_tokens,
                                     sampler=sampler, logits_processors=processors, prompt_cache=cache,
                                     kv_bits=self.kv_bits, kv_group_size=self.kv_group_size, quantized_kv_start=0):
                fed.append(r.token)
                line = token_line(r.token, lead.fix(r.token, r.text), r.logprobs, job.gen)
                job.emit(("token", line, r.finish_reason))
                if job.cancel.is_set():
                    break
            if job.on_finished is not None:  # the store keeps as many of `fed` as the cache holds
                job.on_finished(fed, cache)
        except Exception as e:  # reported to the caller as an error line, never a dead stream
            log.exception("generation failed")
            job.emit(("error", f"{type(e).__name__}: {e}"))
        finally:
            self.batch_size = self.cache_bytes = 0
            job.emit(None)


def _kv_dtype(model):
    """The dtype mlx-lm's own prefill stores this model's KV in: one token through a fresh cache. Authoritative
    where the weights are not: a 4-bit model's first parameter is uint32 (its scales set the activations' dtype)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    return cache[0].state[0].dtype


def _harmony_stops(tokenizer) -> None:
    """gpt-oss ends a turn with <|return|> or <|call|>; its config.json names only <|return|> as EOS."""
    vocab = tokenizer.vocab
    if "<|return|>" in vocab and "<|call|>" in vocab:
        for t in ("<|return|>", "<|call|>"):
            tokenizer.add_eos_token(t)


def _grammar_compiler(tokenizer, vocab_size: int):
    """The model's GrammarCompiler (about a second to build), or None where llguidance is not installed: a request
    with a grammar is then refused with a 400."""
    try:
        from backends.decode.grammar import GrammarCompiler

        return GrammarCompiler(tokenizer._tokenizer, vocab_size, list(tokenizer.eos_token_ids))
    except ImportError:
        log.warning("llguidance is not installed: JSON mode and structured outputs are refused")
        return None


def _nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)
