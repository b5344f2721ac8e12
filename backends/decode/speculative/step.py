"""One generation decoded speculatively on the MLX thread: draft k tokens, verify them in one forward of the target
over the request's own cache, keep the agreed prefix, trim the cache for the rest (backends/decode/engine.py runs it
while the model's batch would hold this one generation only, and hands it to the batch when another arrives).

Lossless: row i of the verify forward is the distribution plain decoding would sample token i from (same cache,
same context), and it goes through the request's own logits processors (penalties, logit bias, the grammar) and its
own sampler, called once per emitted token as plain decoding calls them. A drafted token is kept when the sampled
token equals it; the first that differs is emitted in its place and the step ends. For a deterministic draft that is
the standard accept/reject rule (accept d with probability p(d), else sample p with d removed, renormalised), and
greedy output equals plain decoding token for token; a seeded sampler draws the same keys in the same order.
"""

from __future__ import annotations

import logging

from backends.decode.batch import LeadingSpace, _finish, _Running, token_line
from backends.decode.speculative.control import outcome
from backends.decode.speculative.drafters import DraftModel, PromptLookup
from backends.decode.speculative.learned import LEARNED, make_source
from backends.decode.sampling import make_sampling

log = logging.getLogger("backends.decode.node")

PREFILL_CHUNK = 512  # prompt tokens per loop step while prefilling, so an arriving request waits at most one chunk
CONTEXT = 64  # tokens handed to the logits processors (penalties look at the last 20, the grammar at the last one)


class SpecRun:
    """A job on the speculative path. MLX thread only. `start()` builds its cache (False: not trimmable, the batch
    must take it); `step()` advances one prefill chunk (the target's, then a draft model's) or one verify step and
    returns False once the job has left; `wants_batch` says when speculation is off and the batch should take it."""

    def __init__(self, m, job) -> None:
        self.m, self.job, self.ctl = m, job, m.speculation
        self.run = _Running(job, m.tokenizer.detokenizer, LeadingSpace(m.tokenizer))
        self.cache = self.drafter = None
        self.seq = [*job.history, *job.tokens]  # every token fed or emitted; the cache holds seq[:fed]
        self.fed = len(job.history)
        self.n = 0  # tokens emitted
        self.sampler, self.processors = make_sampling(job.gen, [], m.vocab_size, job.grammar)
        self.eos = set(m.tokenizer.eos_token_ids)
        self._plain_off = 0  # consecutive plain steps while the controller is off
        self.pending = None  # a plain step's (token, logprobs), lazy, evaluating: not yet emitted
        self._chain = True  # whether the next plain step starts before the pending token is read

    def start(self) -> bool:
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        from kv_bridge.mlx.cache import rollback_caches

        job = self.job
        cache = job.make_cache() if job.make_cache else make_prompt_cache(self.m.model)
        self.cache = rollback_caches(cache)  # sliding-window layers (gpt-oss) roll back past their window
        if not can_trim_prompt_cache(self.cache):  # e.g. a recurrent layer's state: the batch must take it
            return False
        cfg = self.ctl.cfg
        if cfg.method in LEARNED:  # its own cache, fed the hidden states of this generation's target forwards
            self.drafter = make_source(cfg.method, self.m.draft_model, self.m.model, self.seq, self.cache)
        else:
            self.drafter = (DraftModel(self.m.draft_model, self.seq) if cfg.method == "draft"
                            else PromptLookup(self.seq, cfg.ngram_min, cfg.ngram_max))
        self.ctl.new_generation()
        return True

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache or ())

    def step(self) -> bool:
        import mlx.core as mx

        if self.job.cancel.is_set():
            self._leave()
            return False
        try:
            if self.fed < len(self.seq) - 1:  # the prompt's uncached part, minus its last token, a chunk a step
                end = min(self.fed + PREFILL_CHUNK, len(self.seq) - 1)
                self.m.model(mx.array([self.seq[self.fed:end]]), cache=self.cache)
                mx.eval([c.state for c in self.cache])
                self.fed = end
                return True
            if self.drafter.prefill_step():  # a draft model's own prefill, a chunk a step like any prompt
                return True
            if self.pending is not None:
                return self._advance_plain()
            k = min(self.ctl.draft_len(), self.job.gen.max_tokens - self.n - 1)
            drafts = self.drafter.draft(k) if k > 0 else []
            if not drafts:  # a plain step, pipelined: its token is read at the next step
                self.pending = self._launch(mx.array(self.seq[-1:]), mx.array(self.seq[-CONTEXT:]))
                self._plain(True)
                return True
            return self._verify(drafts)
        except Exception as e:  # the request's failure, reported as its error line; the loop goes on
            log.exception("speculative generation failed")
            self.job.emit(("error", f"{type(e).__name__}: {e}"))
            self._leave()
            return False

    def _launch(self, y, context):
        """A plain step as BatchGenerator runs it: the forward over y (known, or the lazy token of the step before),
        its row through the processors and the sampler, evaluated asynchronously: (token, logprobs), both lazy."""
        import mlx.core as mx

        row = self.m.model(y.reshape(1, 1), cache=self.cache)[0]  # (1, vocab)
        self.fed += 1
        for p in self.processors:
            row = p(context, row)
        logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
        token = self.sampler(logprobs)
        mx.async_eval(token, logprobs)
        return token, logprobs

    def _advance_plain(self) -> bool:
        """The pending token: while nothing can be drafted, build and start the next plain step on it before reading
        it (the pipeline), then emit it."""
        import mlx.core as mx

        token, logprobs = self.pending
        self.pending = None
        if self._chain and self.n + 1 < self.job.gen.max_tokens:
            context = mx.concatenate([mx.array(self.seq[-(CONTEXT - 1):]), token.astype(mx.int32)])
            self.pending = self._launch(token, context)
            self._plain(False)
        if self._emit(int(token.item()), logprobs):
            self._leave()
            return False
        # Go on chaining while the drafter has nothing for the text so far; else the next step reads the pending
        # token and drafts from there.
        self._chain = self.ctl.draft_len() == 0 or (isinstance(self.drafter, PromptLookup)
                                                    and not self.drafter.draft(1))
        return True

    def _plain(self, first: bool) -> None:
        self.ctl.record(0, 0)
        self._chain = self._chain if not first else True
        self._plain_off = self._plain_off + 1 if self.ctl.k == 0 else 0

    def settle(self) -> bool:
        """Before the batch takes it: the pending token, if any, read and emitted (its sampler draw is spent).
        False: that token ended the generation, which has left."""
        if self.pending is None:
            return True
        token, logprobs = self.pending
        self.pending = None
        if self._emit(int(token.item()), logprobs):
            self._leave()
            return False
        return True

    def _emit(self, token: int, logprobs) -> bool:
        """One sampled token to the request, in order; True when it ends the generation."""
        gen = self.job.gen
        self.seq.append(token)
        self.n += 1
        reason = "stop" if token in self.eos else "length" if self.n >= gen.max_tokens else None
        self.job.emit(("token", token_line(token, self.run.text(token, reason), logprobs[0], gen), reason))
        return reason is not None

    def _verify(self, drafts: list[int]) -> bool:
        import mlx.core as mx
        from mlx_lm.models.cache import trim_prompt_cache

        before = len(self.seq)
        inputs = [self.seq[-1], *drafts]
        logits = self.m.model(mx.array([inputs]), cache=self.cache)[0]  # (1 + len(drafts), vocab)
        self.fed += len(inputs)
        finished = False

        def pick(row):
            nonlocal finished
            if self.processors:
                context = mx.array(self.seq[-CONTEXT:])
                for p in self.processors:
                    row = p(context, row)
            logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
            token = int(self.sampler(logprobs).item())
            finished = self._emit(token, logprobs)
            return token, finished

        kept = accept_drafts(logits, drafts, pick)
        # The cache ran every input; it keeps y and the drafted tokens that were emitted as drafted.
        extra = self.fed - (len(self.seq) - 1)
        if extra > 0:
            if trim_prompt_cache(self.cache, extra) != extra:  # never decode on with refused tokens in the cache
                raise RuntimeError("the cache could not drop the refused drafted tokens")
            self.fed -= extra
        self.drafter.accepted(kept)
        self.ctl.record(len(drafts), *outcome(drafts, self.seq[before:]))
        if finished:
            self._leave()
            return False
        self._plain_off = 0
        return True

    @property
    def wants_batch(self) -> bool:
        """Speculation is off for this generation: the controller is off and not probing, or its probe found
        nothing to draft for probe_every steps. The batch (pipelined) decodes plain steps faster."""
        ctl = self.ctl
        if not ctl.cfg.adaptive or ctl.k > 0 or self.fed < len(self.seq) - 1:
            return False
        return ctl.draft_len() == 0 or self._plain_off >= ctl.cfg.probe_every

    def _leave(self) -> None:
        """Finished or cancelled: the cache (holding seq[:fed]) goes to on_finished, then the job's end."""
        if self.drafter is not None:
            self.drafter.close()
        _finish(self.job, self.seq[:self.fed], self.cache)

    def fail(self, message: str) -> None:
        self.job.emit(("error", message))
        self.job.emit(None)

    def handoff(self) -> dict:
        """What the batch needs to carry this generation on where it stands (Batch.adopt): the tokens still to run
        (at least the last one emitted), the cache of those before, the budget left, and the same sampler,
        processors and detokenizer (a seed's key and a grammar's state go on from here)."""
        if self.drafter is not None:
            self.drafter.close()
        return dict(tokens=self.seq[self.fed:], cache=self.cache, all_tokens=self.seq[:self.fed],
                    max_tokens=self.job.gen.max_tokens - self.n, sampler=self.sampler, processors=self.processors,
                    running=self.run)


def accept_drafts(logits, drafts: list[int], pick) -> int:
    """The accept rule over a verify forward's rows (row i: the distribution of the i-th token of this step).
    `pick(row) -> (token, finished)` samples row i as plain decoding would (processors, sampler) and emits it. A
    drafted token is kept when the sampled token equals it (probability p(d): the standard rule for a deterministic
    draft); the first that differs is emitted in its place (p with d removed, renormalised) and ends the step, and
    when every draft is kept the last row adds one token more. Returns how many drafted tokens were kept."""
    for i in range(len(drafts) + 1):
        token, finished = pick(logits[i:i + 1])
        if finished or i == len(drafts) or token != drafts[i]:
            return i
    return len(drafts)
