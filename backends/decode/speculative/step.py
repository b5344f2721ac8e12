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
import time

from backends.decode.batch import LeadingSpace, _finish, _Running, token_line
from backends.decode.speculative.control import Proposal
from backends.decode.speculative.sources import make_sources
from backends.decode.sampling import make_sampling

log = logging.getLogger("backends.decode.node")

PREFILL_CHUNK = 512  # prompt tokens per loop step while prefilling, so an arriving request waits at most one chunk
CONTEXT = 64  # tokens handed to the logits processors (penalties look at the last 20, the grammar at the last one)


class SpecRun:
    """A job on the speculative path. MLX thread only. `start()` builds its cache (False: not trimmable, the batch
    must take it) and its drafting sources; `step()` advances one prefill chunk (the target's, then a source's own)
    or one plain or verify step and returns False once the job has left. It stays on this path to its end unless
    another generation comes to share the model's batch (the engine decides): being off is no reason to leave."""

    def __init__(self, m, job) -> None:
        self.m, self.job, self.ctl = m, job, m.speculation
        self.run = _Running(job, m.tokenizer.detokenizer, LeadingSpace(m.tokenizer))
        self.cache = None
        self.sources: list = []
        self.seq = [*job.history, *job.tokens]  # every token fed or emitted; the cache holds seq[:fed]
        self.fed = len(job.history)
        self.n = 0  # tokens emitted
        self.sampler, self.processors = make_sampling(job.gen, [], m.vocab_size, job.grammar)
        self.eos = set(m.tokenizer.eos_token_ids)
        self.cap = getattr(m, "draft_cap", None)  # the fused-attention cap on k (sources.fused_cap)
        self.pending = None  # a plain step's (token, logprobs), lazy, evaluating: not yet emitted
        self._chain = True  # whether the next plain step starts before the pending token is read
        self._shadow: list[tuple[object, Proposal]] = []  # free sources' drafts for the pending token, to score
        self._tick: float | None = None  # when the last chained plain token was read (a 1-row step's interval)
        self.alone = True  # the engine's: False while others step between this one's steps (intervals not timed)

    def start(self) -> bool:
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        from kv_bridge.mlx.cache import rollback_caches

        job = self.job
        cache = job.make_cache() if job.make_cache else make_prompt_cache(self.m.model)
        self.cache = rollback_caches(cache)  # sliding-window layers (gpt-oss) roll back past their window
        if not can_trim_prompt_cache(self.cache):  # e.g. a recurrent layer's state: the batch must take it
            return False
        self.sources = make_sources(self.m, self.seq, self.ctl.cfg, self.cache)
        if job.draft_kv is not None:  # the prefill node ran the head over the prompt: its KV, not a cold start
            for src in self.sources:
                if getattr(src, "install_prompt_kv", lambda *a: False)(*job.draft_kv):
                    self.ctl.stats.draft_kv_tokens += job.draft_kv[1].shape[2]
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
            if any(s.prefill_step() for s in self.sources):  # a draft model's own prefill, a chunk a step
                return True
            t0, n0 = time.perf_counter(), self.n
            going = self._decode()
            # its wall time and tokens: the path's measured rate (SpecController.share weighs it against the batch)
            self.ctl.meter.add_path(self.n - n0, time.perf_counter() - t0)
            return going
        except Exception as e:  # the request's failure, reported as its error line; the loop goes on
            log.exception("speculative generation failed")
            self.job.emit(("error", f"{type(e).__name__}: {e}"))
            self._leave()
            return False

    def _decode(self) -> bool:
        """One decode step: the pending plain token read (and the next launched), or a draft and then a plain
        launch or a verify."""
        import mlx.core as mx

        if self.pending is not None:
            return self._advance_plain()
        props = self._draft(self._limit(), costly=True)
        choice = self.ctl.choose([p for _, p in props], len(self.seq), self._limit())
        if choice is None:  # a plain step, pipelined: its token is read at the next step
            self.pending = self._launch(mx.array(self.seq[-1:]), mx.array(self.seq[-CONTEXT:]))
            self._shadow = props
            self.ctl.plain()
            return True
        return self._verify(props, *choice)

    def _limit(self) -> int:
        """The most tokens a verify step may draft now: num_draft, the fused-attention cap, the tokens left."""
        room = self.job.gen.max_tokens - self.n - 1
        return min(self.ctl.cfg.num_draft, self.cap or self.ctl.cfg.num_draft, room)

    def _draft(self, limit: int, costly: bool) -> list[tuple[object, Proposal]]:
        """Every free source's draft of up to `limit` tokens, and (`costly`) a costly one's (a model: its drafts are
        timed) where the controller asks for one; (source, proposal) for those that proposed something."""
        out = []
        if limit < 1:
            return out
        depth = len(self.seq)
        for src in self.sources:
            cost = self.ctl.draft_cost(src.name, getattr(src, "draft_cost", 0.0), depth)
            k = limit
            if self.ctl.costly(src.name, cost):
                k = self.ctl.ask(src.name, src.match_len, depth, limit, cost) if costly else 0
            t0 = time.perf_counter()
            tokens = src.draft(k) if k > 0 else []
            if tokens:
                self.ctl.timed_draft(src.name, time.perf_counter() - t0, len(tokens))
                out.append((src, Proposal(src.name, tokens, src.match_len, cost)))
        return out

    def _score(self, props: list[tuple[object, Proposal]], emitted: list[int], chosen=None, k: int = 0):
        """Each proposal against what the target emitted: its arm learns, its source hears how many it kept.
        Returns the chosen one's (accepted, rejected)."""
        got = (0, 0)
        for src, p in props:
            a, r = self.ctl.observe(p, emitted, k if src is chosen else None)
            src.accepted(a)
            got = (a, r) if src is chosen else got
        return got

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
        """The pending token: while the controller would not verify, build and start the next plain step on it
        before reading it (the pipeline), then emit it. Free sources draft for the token in flight; their drafts
        are scored when it is read (what a probe would have learned, at no cost)."""
        import mlx.core as mx

        token, logprobs = self.pending
        self.pending = None
        chained = self._chain and self.n + 1 < self.job.gen.max_tokens
        if chained:
            context = mx.concatenate([mx.array(self.seq[-(CONTEXT - 1):]), token.astype(mx.int32)])
            self.pending = self._launch(token, context)
            self.ctl.plain()
        t = int(token.item())
        now = time.perf_counter()
        if self._tick is not None and self.alone:  # one pipelined 1-row step's interval
            self.ctl.meter.add(1, len(self.seq), now - self._tick)
        self._tick = now if chained else None
        if self._emit_plain(t, logprobs):
            self._leave(finished=True)
            return False
        if self.pending is not None:  # drafts for the token in flight; verify from there if one would pay
            self._shadow = self._draft(self._limit(), costly=False)
            depth = len(self.seq) + 1
            self._chain = not (self.ctl.would_verify([p for _, p in self._shadow], depth, self._limit())
                               or self._costly_asked(depth))
        return True

    def _costly_asked(self, depth: int) -> bool:
        """Whether a costly source (a model: it drafts only when asked, so it has no free draft in the shadow) would
        be asked for tokens at the next step (its draft would pay, or a probe is due): the pipeline stops for it.
        Without this a model's drafts, once timed as costly, were never asked for again on a pipelined run."""
        limit = self._limit()
        for src in self.sources:
            cost = self.ctl.draft_cost(src.name, getattr(src, "draft_cost", 0.0), depth)
            if self.ctl.costly(src.name, cost) and self.ctl.ask(src.name, src.match_len, depth, limit, cost) > 0:
                return True
        return False

    def _emit_plain(self, token: int, logprobs) -> bool:
        """A plain step's token: the drafts made for it scored, then emitted; True when it ends the generation."""
        shadow, self._shadow = self._shadow, []
        finished = self._emit(token, logprobs)
        self._score(shadow, [token])  # after the token is in seq, as after a verify step
        return finished

    def settle(self) -> bool:
        """Before the batch takes it: the pending token, if any, read and emitted (its sampler draw is spent).
        False: that token ended the generation, which has left."""
        if self.pending is None:
            return True
        token, logprobs = self.pending
        self.pending = None
        if self._emit_plain(int(token.item()), logprobs):
            self._leave(finished=True)
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

    def _verify(self, props: list[tuple[object, Proposal]], chosen: int, k: int) -> bool:
        """One verify step over proposal `chosen`'s first k tokens; every proposal is scored against the outcome.
        Its wall time (forward, accept, trim) is the k + 1-row sample of the measured verify cost."""
        import mlx.core as mx
        from mlx_lm.models.cache import trim_prompt_cache

        t0 = time.perf_counter()
        src, prop = props[chosen]
        drafts = prop.tokens[:k]
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

        accept_drafts(logits, drafts, pick)
        # The cache ran every input; it keeps y and the drafted tokens that were emitted as drafted.
        extra = self.fed - (len(self.seq) - 1)
        if extra > 0:
            if trim_prompt_cache(self.cache, extra) != extra:  # never decode on with refused tokens in the cache
                raise RuntimeError("the cache could not drop the refused drafted tokens")
            self.fed -= extra
        self.ctl.meter.add(k + 1, before, time.perf_counter() - t0)
        self._tick = None
        self.ctl.verified(prop.name, k, *self._score(props, self.seq[before:], src, k))
        if finished:
            self._leave(finished=True)
            return False
        return True

    def _close_sources(self, finished: bool = False) -> None:
        for src in self.sources:
            if finished and hasattr(src, "finish"):  # a completed answer (suffix: the model's store of answers)
                src.finish()
            src.close()
        self.sources = []

    def _leave(self, finished: bool = False) -> None:
        """Finished (EOS, max_tokens) or cancelled (a stop string, the client gone, an error): the cache (holding
        seq[:fed]) goes to on_finished, then the job's end."""
        self._close_sources(finished)
        _finish(self.job, self.seq[:self.fed], self.cache)

    def fail(self, message: str) -> None:
        self.job.emit(("error", message))
        self.job.emit(None)

    def handoff(self) -> dict:
        """What the batch needs to carry this generation on where it stands (Batch.adopt): the tokens still to run
        (at least the last one emitted), the cache of those before, the budget left, and the same sampler,
        processors and detokenizer (a seed's key and a grammar's state go on from here)."""
        self._close_sources()
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
