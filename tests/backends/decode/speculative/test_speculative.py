"""Speculative decoding on the decode node (backends/decode/speculative/step.py): greedy output equals mlx-lm's own plain
generation token for token, a seeded sampled request equals the plain batch's, a grammar composes, a second request
hands the first to the batch, and the accept rule keeps the target's distribution (real model logits, fixed seed).
All on the embedded SmolLM2-135M through the decode node's MLX loop (engine tier; mlx-cpu, ~0.1 s a token here):
a few dozen tokens each. The accept rule's distribution and the controller: tests/backends/decode/speculative/test_spec_control.py.
"""

from __future__ import annotations

import threading

import pytest

from backends.decode.engine import Job, MLXModel
from backends.decode.speculative.drafters import load_draft, truncated_draft
from backends.decode.speculative.control import SpecController
from tests.support.fakes import MODEL_DIR
from kv_bridge.config.speculative import SpeculativeConfig
from kv_bridge.protocol import Sampling

CODE = "def area(width, height):\n    return width * height\n\ndef perimeter(width, height):\n" \
       "    return 2 * (width + height)\n"
# Held out: no prompt here was used to build or tune anything.
pytestmark = pytest.mark.e2e

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


_REFERENCE: dict[tuple[int, ...], list[int]] = {}
REFERENCE_TOKENS = 32  # the longest any test asks for: one run per prompt, its first n tokens for each test


def reference(m: MLXModel, ids: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy generation (stream_generate, which stops after EOS), once per prompt: greedy's first n
    tokens are the first n of a longer run (mlx-cpu prefills slowly: each prompt once, not once per test)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    assert n <= REFERENCE_TOKENS
    if tuple(ids) not in _REFERENCE:
        _REFERENCE[tuple(ids)] = [r.token for r in stream_generate(m.model, m.tokenizer, ids,
                                                                   max_tokens=REFERENCE_TOKENS,
                                                                   sampler=make_sampler(0.0))]
    return _REFERENCE[tuple(ids)][:n]


def test_prompt_lookup_greedy_equals_plain_decoding(node):
    """A prompt asking for its own code back: greedy output is mlx-lm's token for token, and prompt lookup's drafts
    are kept (bench/bench_spec.py measures how many per verify step)."""
    ctl = use(node, method="prompt_lookup", num_draft=4, adaptive=False)
    ids = chat(node, PROMPTS[0])
    assert generate(node, ids, max_tokens=32, temperature=0.0) == reference(node, ids, 32)
    s = ctl.stats
    assert s.requests == {"speculative": 1} and s.verify_steps > 0 and 0 <= s.accepted <= s.drafted
    assert s.accepted / s.verify_steps >= 1.0, s


def test_draft_model_greedy_equals_plain_decoding(node, tmp_path):
    keep = [i for i in range(30) if i not in DRAFT_SKIP]
    draft = truncated_draft(str(MODEL_DIR), str(tmp_path / "draft"), keep)
    node.draft_model = load_draft(draft, node.tokenizer, node.vocab_size)
    ctl = use(node, method="draft", draft_path=draft, num_draft=3, adaptive=False)
    ids = chat(node, PROMPTS[1])
    assert generate(node, ids, max_tokens=16, temperature=0.0) == reference(node, ids, 16)
    assert ctl.stats.drafted > 0 and ctl.stats.accepted > 0


def test_seeded_sampling_equals_the_plain_batch(node):
    """The request's own seeded sampler draws once per emitted token on both paths: the same tokens."""
    ids = chat(node, PROMPTS[0])
    sampling = dict(max_tokens=20, temperature=0.3, top_p=0.9, seed=7)  # the lab's settings
    use(node, method="off")
    plain = generate(node, ids, **sampling)
    ctl = use(node, method="prompt_lookup", num_draft=4, adaptive=False)
    assert generate(node, ids, **sampling) == plain
    assert ctl.stats.verify_steps > 0


def test_json_mode_composes(node):
    """The grammar masks each row before it is sampled: JSON mode gives what the plain batch gives."""
    ids = chat(node, "Describe the student's code as JSON: " + CODE)
    sampling = dict(max_tokens=16, temperature=0.0, grammar={"type": "json_object"})
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
