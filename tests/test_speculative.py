"""Speculative decoding on the decode node (backends/speculative.py): greedy output equals mlx-lm's own plain
generation token for token, a seeded sampled request equals the plain batch's, a grammar composes, a second request
hands the first to the batch, and the accept rule keeps the target's distribution (real model logits, fixed seed).
All on the embedded SmolLM2-135M (mlx-cpu, ~0.1 s a token here): a few dozen tokens each.
"""

from __future__ import annotations

import threading

import pytest

from backends.decode_engine import Job, MLXModel
from backends.drafters import PromptLookup, truncated_draft
from backends.spec_control import SpecController
from backends.speculative import accept_drafts
from fakes import MODEL_DIR
from kv_bridge.config_spec import SpeculativeConfig
from kv_bridge.protocol import Sampling

CODE = "def area(width, height):\n    return width * height\n\ndef perimeter(width, height):\n" \
       "    return 2 * (width + height)\n"
# Held out: no prompt here was used to build or tune anything.
PROMPTS = ["Here is a student's code:\n" + CODE + "\nRepeat the code exactly.",
           "Name three rivers in Europe."]
DRAFT_SKIP = (12, 15, 18, 21)  # the layers the test draft drops (bench/bench_spec.py's draft)


@pytest.fixture(scope="module")
def node():
    """The decode node's MLX model and loop, speculation switched per test (`use`)."""
    m = MLXModel("smollm2:135m", str(MODEL_DIR))
    m.load()
    m.start()
    yield m
    m.stop()


def use(m: MLXModel, **cfg) -> SpecController:
    m.speculation = SpecController(SpeculativeConfig(**cfg))
    return m.speculation


def chat(m: MLXModel, text: str) -> list[int]:
    return m.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def submit(m: MLXModel, ids: list[int], **sampling) -> tuple[list, threading.Event]:
    out, done = [], threading.Event()

    def emit(ev):
        if ev is None:
            done.set()
        else:
            out.append(ev)
    gen = Sampling.from_json(sampling)
    m.submit(Job(tokens=list(ids), gen=gen, emit=emit, grammar=m.grammar_for(gen, ids)))
    return out, done


def generate(m: MLXModel, ids: list[int], **sampling) -> list[int]:
    out, done = submit(m, ids, **sampling)
    assert done.wait(300)
    assert all(ev[0] == "token" for ev in out), out
    return [ev[1].token_id for ev in out]


def reference(m: MLXModel, ids: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy generation (stream_generate, which stops after EOS)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    return [r.token for r in stream_generate(m.model, m.tokenizer, ids, max_tokens=n, sampler=make_sampler(0.0))]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_lookup_greedy_equals_plain_decoding(node, prompt):
    ctl = use(node, method="prompt_lookup", num_draft=4, adaptive=False)
    ids = chat(node, prompt)
    assert generate(node, ids, max_tokens=24, temperature=0.0) == reference(node, ids, 24)
    assert ctl.stats.verify_steps > 0 and ctl.stats.requests == {"speculative": 1}
    assert 0 <= ctl.stats.accepted <= ctl.stats.drafted


def test_prompt_lookup_drafts_what_the_prompt_repeats(node):
    """A prompt asking for its own code back: prompt lookup drafts it and the target keeps most of it."""
    ctl = use(node, method="prompt_lookup", num_draft=4, adaptive=False)
    generate(node, chat(node, PROMPTS[0]), max_tokens=32, temperature=0.0)
    s = ctl.stats
    assert s.accepted / s.verify_steps >= 1.0, s  # tokens kept per verify step (bench/bench_spec.py measures it)


def test_draft_model_greedy_equals_plain_decoding(node, tmp_path):
    keep = [i for i in range(30) if i not in DRAFT_SKIP]
    draft = truncated_draft(str(MODEL_DIR), str(tmp_path / "draft"), keep)
    from backends.drafters import load_draft

    node.draft_model = load_draft(draft, node.tokenizer, node.vocab_size)
    ctl = use(node, method="draft", draft_path=draft, num_draft=3, adaptive=False)
    ids = chat(node, PROMPTS[1])
    assert generate(node, ids, max_tokens=16, temperature=0.0) == reference(node, ids, 16)
    assert ctl.stats.drafted > 0 and ctl.stats.accepted > 0


def test_seeded_sampling_equals_the_plain_batch(node):
    """The request's own seeded sampler draws once per emitted token on both paths: the same tokens."""
    ids = chat(node, PROMPTS[0])
    sampling = dict(max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    use(node, method="off")
    plain = generate(node, ids, **sampling)
    ctl = use(node, method="prompt_lookup", num_draft=4, adaptive=False)
    assert generate(node, ids, **sampling) == plain
    assert ctl.stats.verify_steps > 0


def test_json_mode_composes(node):
    """The grammar masks each row before it is sampled: JSON mode gives what the plain batch gives."""
    ids = chat(node, "Describe the student's code as JSON: " + CODE)
    sampling = dict(max_tokens=24, temperature=0.0, grammar={"type": "json_object"})
    use(node, method="off")
    plain = generate(node, ids, **sampling)
    ctl = use(node, method="prompt_lookup", num_draft=4, adaptive=False)
    assert generate(node, ids, **sampling) == plain
    assert ctl.stats.verify_steps > 0


def test_second_request_hands_the_first_to_the_batch(node):
    """A generation on the speculative path joins the batch when another arrives, and both still equal mlx-lm's."""
    ctl = use(node, method="prompt_lookup", num_draft=4, adaptive=False)
    a, b = chat(node, PROMPTS[0]), chat(node, PROMPTS[1])
    out_a, done_a = submit(node, a, max_tokens=24, temperature=0.0)
    while len(out_a) < 4 and not done_a.is_set():
        done_a.wait(0.05)
    out_b, done_b = submit(node, b, max_tokens=12, temperature=0.0)
    assert done_a.wait(300) and done_b.wait(300)
    assert ctl.stats.requests == {"speculative": 1, "joined_batch": 1, "batch": 1}
    assert [e[1].token_id for e in out_a] == reference(node, a, 24)
    assert [e[1].token_id for e in out_b] == reference(node, b, 12)


def test_accept_rule_keeps_the_target_distribution(node):
    """The accept rule over real verify rows, sampled 4000 times (fixed seed): a drafted token is kept as often as
    the target samples it, and when refused the emitted token follows the target with that token removed."""
    import mlx.core as mx
    import numpy as np
    from backends.sampling import make_sampling

    ids = chat(node, PROMPTS[1])
    logits = node.model(mx.array([ids]))[0, -2:]  # rows for [y, d], d the prompt's real last token
    p0 = np.array(mx.softmax(logits[0].astype(mx.float32)))
    d = int(np.argsort(p0)[-2])  # the second likeliest token: kept and refused alike, often
    sampler, _ = make_sampling(Sampling.from_json({"temperature": 1.0}), [], node.vocab_size)
    mx.random.seed(0)
    firsts, kept, n = [], 0, 4000

    def pick(row):
        t = int(sampler(row - mx.logsumexp(row, axis=-1, keepdims=True)).item())
        emitted.append(t)
        return t, False
    for _ in range(n):
        emitted = []
        k = accept_drafts(logits, [d], pick)
        assert len(emitted) == k + 1 and (k == 1) == (emitted[0] == d)
        kept += k
        firsts.append(emitted[0])
    sd = (p0[d] * (1 - p0[d]) / n) ** 0.5
    assert abs(kept / n - p0[d]) < 4 * sd
    # Refused: the emitted token's distribution is p0 without d; chi-square over the likeliest tokens + the rest.
    refused = np.array([t for t in firsts if t != d])
    q = p0.copy()
    q[d] = 0
    q /= q.sum()
    top = [t for t in np.argsort(q)[::-1][:8] if q[t] * len(refused) >= 10]
    observed = [np.sum(refused == t) for t in top]
    expected = [q[t] * len(refused) for t in top]
    observed.append(len(refused) - sum(observed))
    expected.append(len(refused) - sum(expected))
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert chi2 < 26.1, (chi2, observed, expected)  # p = 0.001 at <= 8 degrees of freedom


def test_prompt_lookup_index():
    seq = [1, 2, 3, 4, 9, 1, 2, 3]
    pl = PromptLookup(seq, 2, 3)
    assert pl.draft(2) == [4, 9]
    seq.extend([7, 7])  # no earlier [3, 7, 7] or [7, 7]
    assert pl.draft(3) == []
    seq.extend([1, 2])  # [7, 1, 2] unseen; [1, 2] last seen at 5 -> 3, 7, 7
    assert pl.draft(3) == [3, 7, 7]
