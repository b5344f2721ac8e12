"""The MLX thread's batch: mlx-lm's BatchGenerator and the jobs in it (backends/decode/engine.py drives it), and how a
sampled token becomes the protocol's token line (its text as vLLM and the tokenizer give it, its logprobs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from backends.decode.sampling import make_sampling, token_logprobs
from kv_bridge.protocol import Sampling, TokenLine

log = logging.getLogger("backends.decode.node")


@dataclass(eq=False)
class _Running:
    """A job in the batch and its own streaming detokenizer."""

    job: "Job"
    detokenizer: object
    lead: "LeadingSpace"

    def text(self, token: int, finish_reason: str | None) -> str:
        """The token's text as stream_generate gives it: an EOS token adds none, the last token flushes."""
        if finish_reason != "stop":
            self.detokenizer.add_token(token)
        if finish_reason is not None:
            self.detokenizer.finalize()
        return self.lead.fix(token, self.detokenizer.last_segment)


class Batch:
    """mlx-lm's BatchGenerator and the jobs in it, by uid. MLX thread only.

    Each job brings its own sampler and logits processors (BatchGenerator applies them row by row); its
    `history` goes in as the uid's `all_tokens`, so penalties see the prompt tokens whose KV came from prefill.
    EOS ends a row with finish_reason "stop"; stop strings are matched on the asyncio side, which cancels.
    """

    def __init__(self, m):
        self.m, self.jobs = m, {}
        self.gen = self._generator()

    def _generator(self):
        from mlx_lm.generate import BatchGenerator

        m = self.m
        return BatchGenerator(m.model, stop_tokens=[[t] for t in m.tokenizer.eos_token_ids],
                              completion_batch_size=m.max_batch_size, prefill_batch_size=min(8, m.max_batch_size))

    def add(self, job: "Job") -> None:
        if job.cancel.is_set():
            job.emit(None)
            return
        try:
            cache = job.make_cache() if job.make_cache else None
            sampler, processors = make_sampling(job.gen, [], self.m.vocab_size, job.grammar)
            self._insert(job.tokens, cache, list(job.history), job.gen.max_tokens, sampler, processors,
                         _Running(job, self.m.tokenizer.detokenizer, LeadingSpace(self.m.tokenizer)))
        except Exception as e:
            self._refuse(job, e)

    def adopt(self, spec) -> None:
        """Carry on a generation the speculative path started (backends/decode/speculative/step.py SpecRun) where it stands."""
        if spec.cache is None:  # it never started: a plain job
            self.add(spec.job)
            return
        try:
            self._insert(**spec.handoff())
        except Exception as e:
            self._refuse(spec.job, e)

    def _insert(self, tokens, cache, all_tokens, max_tokens, sampler, processors, running) -> None:
        (uid,) = self.gen.insert([tokens], max_tokens=[max_tokens], caches=[cache], all_tokens=[all_tokens],
                                 samplers=[sampler], logits_processors=[processors])
        self.jobs[uid] = running

    @staticmethod
    def _refuse(job: "Job", e: Exception) -> None:
        log.exception("could not start generation")
        job.emit(("error", f"{type(e).__name__}: {e}"))
        job.emit(None)

    def step(self) -> int:
        """One BatchGenerator step; the tokens it delivered (one per generation on a decode step, none while it
        prefills an arrival)."""
        self._drop([uid for uid, r in self.jobs.items() if r.job.cancel.is_set()])
        if not self.jobs:
            return 0
        try:
            _, responses = self.gen.next()
        except Exception as e:  # a failed step leaves the batch unusable: fail its jobs, start a fresh one
            log.exception("batch step failed")
            self._fail_all(f"{type(e).__name__}: {e}")
            return 0
        for r in responses:
            self._deliver(r)
        return len(responses)

    def nbytes(self) -> int:
        return self.gen.prompt_cache_nbytes

    def _deliver(self, r) -> None:
        run = self.jobs[r.uid]
        line = token_line(r.token, run.text(r.token, r.finish_reason), r.logprobs, run.job.gen)
        run.job.emit(("token", line, r.finish_reason))
        if r.finish_reason is not None:  # BatchGenerator has already dropped the uid
            del self.jobs[r.uid]
            _finish(run.job, r.all_tokens, r.prompt_cache)

    def _drop(self, uids: list[int]) -> None:
        if not uids:
            return
        want = any(self.jobs[uid].job.on_finished for uid in uids)
        caches = self.gen.remove(uids, return_prompt_caches=want)
        for uid in uids:
            cache, tokens = caches.get(uid, (None, None))
            _finish(self.jobs.pop(uid).job, tokens, cache)

    def _fail_all(self, message: str) -> None:
        self.abandon(message)
        self.gen = self._generator()

    def abandon(self, message: str) -> None:
        """Every job in the batch gets `message` as its error and leaves; the generator is closed."""
        for run in self.jobs.values():
            run.job.emit(("error", message))
            run.job.emit(None)
        self.jobs.clear()
        try:
            self.gen.close()
        except Exception:  # a generator that broke may not close cleanly; it is dropped either way
            log.exception("closing the batch generator failed")


def _finish(job: "Job", tokens: list[int] | None, cache: list | None) -> None:
    """Hand the final cache on (if anyone wants it), then tell the request it has left the loop."""
    try:
        if job.on_finished is not None and cache is not None:
            job.on_finished(list(tokens), cache)
    except Exception:
        log.exception("on_finished failed")
    finally:
        job.emit(None)


class LeadingSpace:
    """mlx-lm's BPE streaming detokenizer drops the leading space of the first text it emits (" Paris" -> "Paris");
    vLLM and the tokenizer's own decode keep it, and a raw completion needs it. Restore it on the first segment."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.settled = tokenizer, [], False

    def fix(self, token: int, text: str) -> str:
        if self.settled:
            return text
        self.ids.append(token)
        if not text:
            return text
        self.settled = True
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return " " + text if full.startswith(" ") and not text.startswith(" ") else text


def token_line(token: int, text: str, logprobs, gen: Sampling) -> TokenLine:
    """The token line for one sampled token (MLX thread: logprobs read an mx.array)."""
    if gen.logprobs is None:
        return TokenLine(token, text)
    lp, top = token_logprobs(logprobs, token, gen.logprobs)
    return TokenLine(token, text, lp, top)
