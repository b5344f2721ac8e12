"""The speculative path equals plain decoding (the model's batch, speculation off) on the tiny random llama and gpt_oss
(tests/support/tiny_models.py), in-process through the decode node's MLX loop: greedy, sampled at the lab's
settings, penalties, logit_bias, logprobs, EOS mid-step, stop strings, max_tokens <= k, a seeded hand-off to the
batch and a grammar; gpt_oss across several turns of its 16-token window. The drafter is the target itself
(method "draft" with the target as its draft model): its drafts are the target's unprocessed argmax, so nearly every
step drafts and a lossy accept rule (keep on argmax, sample every row up front, skip the processors on drafted rows)
shows; with prompt lookup most steps on a random model are plain, pipelined as the batch runs them,
which the same tests check. Each test sets its own speculation and reference; none depends on another having run.
"""

from __future__ import annotations

import threading

import pytest

from backends.decode.engine import Job, MLXModel
from backends.decode.speculative.control import SpecController
from kv_bridge.config.speculative import SpeculativeConfig
from kv_bridge.protocol import Sampling
from kv_bridge.stops import StopMatcher
from tests.support.tiny_models import build

LAB = dict(temperature=0.2, top_p=0.9, seed=5)  # the lab's settings (temperature 0.1-0.3, top_p 0.9), seeded
PROMPT = [1, 504, 3458, 282, 4774, 30, 198, 2730, 314, 253, 1789, 28, 339, 1345, 2569, 29, 1048, 8340, 22, 288, 13,
          4217, 957, 36, 198, 1789, 28, 339, 1345]  # 29 tokens: past the tiny gpt_oss's 16-token window


def _model(folder, model_type: str, eos: int | None = None) -> MLXModel:
    m = MLXModel(f"tiny-{model_type}", str(build(model_type, folder)))
    m.executor.submit(m.load).result()  # on the model's own thread, as the node loads it (MLX streams are per thread)
    if eos is not None:
        m.tokenizer.add_eos_token(str(eos))
    m.draft_model = m.model  # the target drafts for itself (see the module docstring)
    m.start()
    return m


@pytest.fixture(scope="module", params=["llama", "gpt_oss"])
def tiny(request, tmp_path_factory):
    m = _model(tmp_path_factory.mktemp(request.param), request.param)
    yield m
    m.stop()


def use(m: MLXModel, method: str = "draft", **cfg) -> SpecController:
    cfg.setdefault("num_draft", 4)
    cfg.setdefault("adaptive", False)
    m.speculation = SpecController(SpeculativeConfig(method=method, draft_path="self" if method == "draft" else None,
                                                     **cfg))
    return m.speculation


def submit(m: MLXModel, ids, stop_at: StopMatcher | None = None, **sampling):
    """(events, done): every ("token", line, reason) the job emits; `stop_at` cancels the job as the node's
    asyncio side does when a stop string appears in the text."""
    out, done = [], threading.Event()
    gen = Sampling.from_json(sampling)
    job = Job(tokens=list(ids), gen=gen, emit=None, grammar=m.grammar_for(gen, list(ids)))

    def emit(ev):  # the MLX thread: record, never raise (an error line is in `out` for the test to see)
        if ev is None:
            done.set()
            return
        out.append(ev)
        if ev[0] == "token" and stop_at is not None and stop_at.feed(ev[1].text)[1]:
            job.cancel.set()
    job.emit = emit
    m.submit(job)
    return out, done


def generate(m: MLXModel, ids=PROMPT, **sampling) -> list:
    out, done = submit(m, ids, **sampling)
    assert done.wait(120)
    assert all(e[0] == "token" for e in out), out
    return out


def tokens(events) -> list[int]:
    assert all(e[0] == "token" for e in events), events
    return [e[1].token_id for e in events]


def plain_and_spec(m: MLXModel, method: str = "draft", ids=PROMPT, **sampling):
    """(plain events, speculative events, the speculative run's controller)."""
    use(m, "off")
    plain = generate(m, ids, **sampling)
    ctl = use(m, method)
    spec = generate(m, ids, **sampling)
    return plain, spec, ctl


@pytest.mark.parametrize("method", ["draft", "prompt_lookup", "suffix"])
def test_greedy_equals_plain_decoding(tiny, method):
    """60 tokens: on the tiny gpt_oss, past its 16-token window from the prompt on and through 3 more turns of it."""
    plain, spec, ctl = plain_and_spec(tiny, method, max_tokens=60, temperature=0.0)
    assert tokens(spec) == tokens(plain) and len(plain) == 60
    assert ctl.stats.requests == {"speculative": 1}
    if method == "draft":
        assert ctl.stats.verify_steps > 0 and ctl.stats.accepted > 0


@pytest.mark.parametrize("method", ["draft", "prompt_lookup", "suffix"])
def test_sampled_at_the_labs_settings_equals_plain_decoding(tiny, method):
    """prompt_lookup on a random model: mostly plain steps, pipelined (the next built before the last is read)."""
    plain, spec, ctl = plain_and_spec(tiny, method, max_tokens=48, **LAB)
    assert tokens(spec) == tokens(plain)
    assert ctl.stats.plain_steps > 0 if method != "draft" else ctl.stats.accepted > 0


def test_suffix_drafts_from_the_models_earlier_answers(tiny):
    """A class's second answer: the first one's tokens, kept in the model's suffix store when its generation
    completed, are drafted and kept (a random model's text has nothing else to match), and the output is still plain
    decoding's. A cancelled generation (a stop string) adds nothing to the store."""
    tiny.suffix_store = None
    use(tiny, "off")
    plain = tokens(generate(tiny, max_tokens=40, temperature=0.0))
    use(tiny, "suffix", adaptive=True, num_draft=3)
    first = tokens(generate(tiny, max_tokens=40, temperature=0.0))
    assert first == plain and tiny.suffix_store.answers == 1
    ctl = use(tiny, "suffix", adaptive=True, num_draft=3)
    second = tokens(generate(tiny, max_tokens=40, temperature=0.0))
    assert second == plain and ctl.stats.accepted >= 10, ctl.stats
    assert tiny.suffix_store.answers == 2
    out, done = submit(tiny, PROMPT, stop_at=StopMatcher([tiny.tokenizer.decode(plain[5:7])]), max_tokens=40,
                       temperature=0.0)
    assert done.wait(120) and tiny.suffix_store.answers == 2


def test_sampled_hot_equals_plain_decoding(tiny):
    """Temperature 1: the target often samples something other than its argmax (the drafted token)."""
    plain, spec, ctl = plain_and_spec(tiny, max_tokens=40, temperature=1.0, seed=3)
    assert tokens(spec) == tokens(plain)
    assert ctl.stats.verify_steps > 0


@pytest.mark.parametrize("method", ["draft", "prompt_lookup"])
def test_penalties_equal_plain_decoding(tiny, method):
    """Each row's penalties see the tokens kept before it in the same step. A random model seldom repeats itself, so
    a bias makes one token the favourite and the penalties have to push it back (the answer differs from the
    unpenalised one)."""
    bias = {504: 6.0}
    use(tiny, "off")
    free = tokens(generate(tiny, max_tokens=40, temperature=0.0, logit_bias=bias))
    plain, spec, ctl = plain_and_spec(tiny, method, max_tokens=40, temperature=0.0, logit_bias=bias,
                                      repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0)
    assert tokens(spec) == tokens(plain) != free
    assert ctl.stats.verify_steps > 0 or method == "prompt_lookup"


def test_logit_bias_equals_plain_decoding(tiny):
    """Bias against the tokens the unbiased model picks: the draft (unbiased) proposes them, the target refuses."""
    use(tiny, "off")
    free = tokens(generate(tiny, max_tokens=24, temperature=0.0))
    bias = {t: -30.0 for t in free[2:12:2]}
    plain, spec, ctl = plain_and_spec(tiny, max_tokens=24, temperature=0.0, logit_bias=bias)
    assert tokens(spec) == tokens(plain) != free
    assert ctl.stats.drafted > ctl.stats.accepted


def test_logprobs_equal_plain_decoding(tiny):
    plain, spec, _ = plain_and_spec(tiny, max_tokens=16, temperature=0.0, logprobs=3)
    assert tokens(spec) == tokens(plain)
    for p, s in zip(plain, spec):
        assert s[1].logprob == pytest.approx(p[1].logprob, abs=1e-3)
        assert [t for t, _ in s[1].top_logprobs] == [t for t, _ in p[1].top_logprobs]


@pytest.mark.parametrize("method", ["draft", "prompt_lookup"])
@pytest.mark.parametrize("max_tokens", [1, 2, 4])
def test_max_tokens_at_most_k(tiny, max_tokens, method):
    plain, spec, _ = plain_and_spec(tiny, method, max_tokens=max_tokens, temperature=0.0)
    assert tokens(spec) == tokens(plain) and len(spec) == max_tokens
    assert spec[-1][2] == plain[-1][2] == "length"


def test_stop_string_equals_plain_decoding(tiny):
    """Cancelled by a stop string mid-step: the text up to the stop is the same (extra tokens of the step are cut
    by the matcher, as the node cuts them)."""
    use(tiny, "off")
    free = generate(tiny, max_tokens=30, temperature=0.0)
    text = "".join(e[1].text for e in free)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()

    def cut(events):
        m = StopMatcher([stop])
        out = ""
        for e in events:
            piece, hit = m.feed(e[1].text)
            out += piece
            if hit:
                return out
        return None

    texts = []
    for method in ("off", "draft"):
        use(tiny, method)
        events, done = submit(tiny, PROMPT, stop_at=StopMatcher([stop]), max_tokens=30, temperature=0.0)
        assert done.wait(300)
        texts.append(cut(events))
    assert texts[0] is not None and texts[1] == texts[0]


def test_eos_mid_step_equals_plain_decoding(tmp_path):
    """A token of the greedy answer made EOS: the verify step that samples it ends there, with reason stop."""
    probe = _model(tmp_path / "a", "llama")
    use(probe, "off")
    free = tokens(generate(probe, max_tokens=20, temperature=0.0))
    probe.stop()
    i = next(i for i in range(6, 20) if free[i] not in free[:i])
    m = _model(tmp_path / "b", "llama", eos=free[i])
    try:
        plain, spec, ctl = plain_and_spec(m, max_tokens=20, temperature=0.0)
    finally:
        m.stop()
    assert tokens(spec) == tokens(plain) == free[:i + 1]
    assert spec[-1][2] == plain[-1][2] == "stop"
    assert ctl.stats.verify_steps > 0


@pytest.mark.parametrize("method", ["draft", "prompt_lookup"])
def test_seeded_hand_off_to_the_batch_equals_plain_decoding(tiny, method):
    """A seeded generation on the speculative path hands itself to the batch when a second request arrives: its
    sampler's key goes on from where it stands, so both answers equal plain decoding's."""
    other = PROMPT[:12]
    use(tiny, "off")
    want_a = tokens(generate(tiny, max_tokens=40, **LAB))
    want_b = tokens(generate(tiny, other, max_tokens=12, **LAB))
    ctl = use(tiny, method)
    out_a, done_a = submit(tiny, PROMPT, max_tokens=40, **LAB)
    while len(out_a) < 8 and not done_a.is_set():
        done_a.wait(0.01)
    out_b, done_b = submit(tiny, other, max_tokens=12, **LAB)
    assert done_a.wait(300) and done_b.wait(300)
    assert tokens(out_a) == want_a and tokens(out_b) == want_b
    assert ctl.stats.requests.get("joined_batch") == 1
    assert ctl.stats.verify_steps > 0 or method == "prompt_lookup"


def test_speculation_off_keeps_a_lone_generation_on_its_path(tiny):
    """Adaptive at a verify cost nothing pays at (verify_cost 1.0, probe_every 8): a lone generation is never handed
    to the batch; its steps are plain but for a few probes (one drafted token each: the smallest k, to measure the
    cost the prior says is hopeless) and the answer is plain decoding's, sampled at the lab's settings."""
    use(tiny, "off")
    want = tokens(generate(tiny, max_tokens=40, **LAB))
    ctl = use(tiny, adaptive=True, verify_cost=1.0, probe_every=8)
    assert tokens(generate(tiny, max_tokens=40, **LAB)) == want
    s = ctl.stats
    assert s.requests == {"speculative": 1} and s.plain_steps >= 30
    assert s.verify_steps == s.probes == s.drafted and s.probes <= 5


@pytest.mark.parametrize("method", ["draft", "prompt_lookup"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), LAB], ids=["greedy", "lab"])
def test_grammar_equals_plain_decoding(tiny, sampling, method):
    plain, spec, ctl = plain_and_spec(tiny, method, max_tokens=24, grammar={"type": "json_object"}, **sampling)
    assert tokens(spec) == tokens(plain)
    assert ctl.stats.verify_steps > 0 or method == "prompt_lookup"
